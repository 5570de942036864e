"""The Debian packaging's pure parts: lintian's verdict, control files,
firmware links, cache keys (the package builds are in `make packages`)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from freepage_lab import packages
from freepage_lab.shell import LabError, Shell

LINTIAN = """\
E: linux-image-6.12.117-freepage: bogus-mail-host Maintainer root@vm
W: qemu-system-x86-freepage: groff-message 32: warning [p 1, 4.3i]: cannot adjust line
I: vhost-user-balloon: spelling-error-in-binary
"""


def test_lintian_errors_and_warnings_are_told_apart() -> None:
    assert packages.lintian_errors(LINTIAN) == [LINTIAN.splitlines()[0]]
    assert packages.lintian_warnings(LINTIAN) == [LINTIAN.splitlines()[1]]


def test_a_lintian_error_fails_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Proc:
        stdout = LINTIAN
        stderr = ""
        returncode = 2

    monkeypatch.setattr(packages.subprocess, "run", lambda *a, **k: Proc())
    with pytest.raises(LabError, match="(?s)1 errors.*bogus-mail-host"):
        packages.run_lintian(Shell(quiet=True), [tmp_path / "x.deb"], tmp_path / "lintian.txt")
    assert (tmp_path / "lintian.txt").read_text() == LINTIAN


def test_control_file_leaves_out_empty_fields() -> None:
    text = packages.control_text({"Package": "p", "Depends": "", "Version": "1"})
    assert text == "Package: p\nVersion: 1\n"


def test_changelog_is_reproducible() -> None:
    one = packages.changelog("p", "1.0-1", "first")
    assert one == packages.changelog("p", "1.0-1", "first")
    assert gzip.decompress(one).decode().startswith("p (1.0-1) unstable; urgency=medium")


def test_firmware_links_take_the_first_directory_with_a_name(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "bios-256k.bin").write_text(d.name)
    (b / "efi-virtio.rom").write_text("b")
    links = packages.firmware_links((a, b, tmp_path / "missing"))
    assert links == {"bios-256k.bin": a / "bios-256k.bin", "efi-virtio.rom": b / "efi-virtio.rom"}


def test_package_key_follows_the_build_and_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    key = packages.package_key("qemu", "abc")
    assert key == packages.package_key("qemu", "abc")
    assert key != packages.package_key("qemu", "abd")
    monkeypatch.setattr(packages, "recipe_digest", lambda what: "another recipe")
    assert key != packages.package_key("qemu", "abc")


def test_a_package_is_keyed_by_its_own_packaging_files_only() -> None:
    assert packages.recipe_digest("kernel") != packages.recipe_digest("daemon")
    assert set(packages.RECIPE_DIRS) == set(packages.WHAT)
    for dirs in packages.RECIPE_DIRS.values():
        assert all((packages.PACKAGING_DIR / d).is_dir() for d in dirs)


def test_the_daemon_unit_keeps_the_experimental_bits_off() -> None:
    unit = (packages.PACKAGING_DIR / "vhost-user-balloon" / packages.DAEMON_UNIT).read_text()
    default = (packages.PACKAGING_DIR / "vhost-user-balloon" / "default").read_text()
    start = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    assert "--socket-path /run/vhost-user-balloon/%i.sock" in start
    assert "--x-" not in start
    assert 'VHOST_USER_BALLOON_ARGS=""' in default


def test_dry_run_prints_every_package_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path))
    results = packages.package_all(Shell(dry_run=True), Path("/nonexistent"))
    assert [r.status for r in results] == ["dry-run"] * 3
    err = capsys.readouterr().err
    for step in ("bindeb-pkg", "strip", "help2man", "dpkg-shlibdeps"):
        assert step in err

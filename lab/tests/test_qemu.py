"""The QEMU patch queue and build: keys, placeholders, checkpatch parsing, dry runs."""

import re
from pathlib import Path

import pytest

from freepage_lab import patchqueue, paths, qemu
from freepage_lab.patchqueue import Series
from freepage_lab.shell import LabError, Shell


def series_of(directory: Path, **patches: str) -> Series:
    directory.mkdir()
    for name, text in patches.items():
        (directory / name).write_text(text)
    return Series(directory, tuple(patches))


def test_build_key_follows_series_and_configure_flags(tmp_path):
    a = series_of(tmp_path / "a", **{"0001-a.patch": "one"})
    b = series_of(tmp_path / "b", **{"0001-a.patch": "two"})
    empty = Series(tmp_path, ())
    assert qemu.build_key(empty) != qemu.build_key(a)
    assert qemu.build_key(a) != qemu.build_key(b)
    assert qemu.build_key(empty) != qemu.build_key(empty, (*qemu.CONFIGURE_FLAGS, "--enable-debug"))
    assert qemu.build_key(empty) == qemu.build_key(Series(tmp_path, ()))


def test_configure_builds_only_the_x86_64_system_emulator():
    argv = qemu.configure_argv(Path("/src"))
    assert argv[0] == "/src/configure"
    assert "--target-list=x86_64-softmmu" in argv
    assert "--python=/usr/bin/python3" in argv


def test_edk2_placeholders_are_the_blobs_meson_lists(tmp_path):
    (tmp_path / "pc-bios").mkdir()
    (tmp_path / "pc-bios" / "meson.build").write_text(
        "fds = [\n    'edk2-x86_64-code.fd',\n    'edk2-i386-vars.fd',\n  ]\n")
    names = [p.name for p in qemu.edk2_placeholders(tmp_path)]
    assert names == ["edk2-x86_64-code.fd.bz2", "edk2-i386-vars.fd.bz2"]


def test_empty_bzip2_placeholder_decompresses_to_nothing():
    import bz2

    assert bz2.decompress(qemu.EMPTY_BZIP2) == b""


def test_checkpatch_problems_are_errors_and_warnings():
    out = ("0001.patch:12: WARNING: line over 80 characters\n"
           "0001.patch:20: ERROR: code indent should never use tabs\n"
           "total: 1 errors, 1 warnings, 30 lines checked\n")
    assert len(qemu.checkpatch_problems(out)) == 2
    assert qemu.checkpatch_problems("") == []


def test_dry_run_build_prints_configure_and_ninja(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path))
    built = qemu.build(Shell(dry_run=True), Series(tmp_path, ()))
    err = capsys.readouterr().err
    assert "configure --target-list=x86_64-softmmu" in err
    assert "ninja -C" in err and "qemu-system-x86_64" in err
    assert built.binary.name == "qemu-system-x86_64"
    assert built.out_dir.parent == qemu.tree_path(Series(tmp_path, ()))
    assert not (tmp_path / "qemu" / "build").exists()


def test_each_series_has_its_directory_and_applies_on_what_it_requires():
    assert list(qemu.QUEUES) == ["dirty-discard", "device-init", "hint-during-pass",
                                 "postcopy-hint", "skip-unpopulated", "first-pass-switchover"]
    # the migration fix and the hint-during-pass change each apply to
    # pristine QEMU alone; postcopy hinting needs only the latter
    assert qemu.QUEUES["dirty-discard"].requires == ()
    assert qemu.QUEUES["hint-during-pass"].requires == ()
    assert qemu.QUEUES["postcopy-hint"].requires == ("hint-during-pass",)
    assert qemu.QUEUES["device-init"].requires == ("dirty-discard",)
    assert qemu.stack() == list(qemu.QUEUES.values())
    for q in qemu.stack():
        assert q.patch_dir == paths.QEMU_DIR / q.name / "patches"
        assert (q.patch_dir / "series").is_file(), f"{q.name}: no series file"
    cover = (qemu.QUEUES["device-init"].patch_dir / patchqueue.COVER).read_text()
    assert "Subject: [PATCH 0/6] virtio-balloon: zero means zero, end to end" in cover
    for rfc in ("skip-unpopulated", "first-pass-switchover"):
        cover = (qemu.QUEUES[rfc].patch_dir / patchqueue.COVER).read_text()
        assert "Subject: [RFC PATCH 0/1]" in cover, rfc


def test_a_build_applies_every_series_in_order():
    series = qemu.load_series()
    assert series.directory == paths.QEMU_DIR
    dirs = [n.split("/")[0] for n in series.names]
    assert dirs == sorted(dirs, key=list(qemu.QUEUES).index)
    assert "device-init" in dirs
    assert all(n.split("/")[-1][:4].isdigit() for n in series.names)
    assert not any(n.endswith(patchqueue.COVER) for n in series.names)
    assert all(f.is_file() for f in series.files)


def test_build_key_is_that_of_the_series_with_patches():
    """An empty series on top rebuilds nothing: the key hashes patch names
    and contents, not the directories they live in."""
    with_patches = [q for q in qemu.stack() if Series.load(q.patch_dir).names]
    alone = Series.joined(with_patches)
    assert qemu.build_key(qemu.load_series()) == qemu.build_key(alone)
    assert qemu.tree_path(qemu.load_series()) == qemu.tree_path(alone)


def test_extra_patches_come_from_qemu_bench_after_every_series(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path))
    plain = qemu.build(Shell(dry_run=True))
    built = qemu.build(Shell(dry_run=True), extra_patches=("no-guest-bounds.patch",))
    assert built.key != plain.key
    applied = re.findall(r"patch -p1 .* -i (\S+)", capsys.readouterr().err)
    want = [*map(str, qemu.load_series().files), str(qemu.BENCH_DIR / "no-guest-bounds.patch")]
    assert applied[-len(want):] == want
    with pytest.raises(LabError, match="qemu/bench/absent.patch does not exist"):
        qemu.build(Shell(dry_run=True), extra_patches=("absent.patch",))


def test_warnings_in_files_the_series_touches_are_found(tmp_path):
    patch = tmp_path / "0001-x.patch"
    patch.write_text("--- a/hw/virtio/virtio-balloon.c\n+++ b/hw/virtio/virtio-balloon.c\n@@\n")
    files = qemu.patched_files(Series(tmp_path, ("0001-x.patch",)))
    assert files == {"hw/virtio/virtio-balloon.c"}
    log = ("../hw/virtio/virtio-balloon.c:108:13: warning: implicit declaration of function\n"
           "../hw/usb/dev-hid.c:10:1: warning: something upstream\n"
           "../hw/virtio/virtio-balloon.c:108:13: note: a note\n")
    assert qemu.series_warnings(log, files) == [log.splitlines()[0]]


def test_tap_status_of_one_case():
    out = ("TAP version 14\n# random seed: R02S\n1..1\n# Start of x86_64 tests\n"
           "ok 1 /x86_64/virtio-balloon/report/in-ram\n")
    assert qemu.tap_status(out, "/x86_64/virtio-balloon/report/in-ram") == "ok"
    skipped = "ok 1 /x86_64/virtio-balloon/inflate/huge-page # SKIP no free 2 MiB huge page\n"
    assert qemu.tap_status(skipped, "/x86_64/virtio-balloon/inflate/huge-page") == "skipped"
    failed = "not ok 1 /x86_64/virtio-balloon/report/over-4g\n"
    assert qemu.tap_status(failed, "/x86_64/virtio-balloon/report/over-4g") == "failed"
    # QEMU (or the test) died before the case printed its line
    died = "1..1\n# Start of x86_64 tests\n"
    assert qemu.tap_status(died, "/x86_64/virtio-balloon/inflate/oversize") == "failed"
    # another case's line does not count
    assert qemu.tap_status(out, "/x86_64/virtio-balloon/report/over-4g") == "failed"


def test_firmware_linked_into_the_bundle(tmp_path):
    out = tmp_path / "build"
    out.mkdir()
    (out / "config-host.h").write_text('#define CONFIG_QEMU_DATADIR "/usr/local/share/qemu"\n')
    fw = tmp_path / "seabios"
    fw.mkdir()
    (fw / "bios-256k.bin").write_bytes(b"\0")
    bundle = out / "qemu-bundle" / "usr" / "local" / "share" / "qemu"
    bundle.mkdir(parents=True)
    (bundle / "keymaps").mkdir()
    (fw / "keymaps").write_text("not linked over the build's own")
    made = qemu.link_firmware(out, (fw, tmp_path / "absent"))
    assert made == [bundle / "bios-256k.bin"]
    assert (bundle / "bios-256k.bin").resolve() == fw / "bios-256k.bin"
    assert qemu.link_firmware(out, (fw,)) == []


def test_qtest_dry_run_builds_the_test_in_the_build_dir(capsys):
    res = qemu.qtest_stage(Shell(dry_run=True))
    assert res.status == "dry-run"
    err = capsys.readouterr().err
    assert "ninja -C" in err and f"tests/qtest/{qemu.QTEST_NAME}" in err


@pytest.mark.parametrize("pristine", [False, True])
def test_migration_test_dry_run_builds_pristine_qemu_only_when_asked(capsys, pristine):
    res = qemu.migration_test_stage(Shell(dry_run=True), pristine=pristine)
    assert res.status == "dry-run"
    err = capsys.readouterr().err
    trees = {qemu.tree_path(qemu.pristine_series()): pristine,
             qemu.tree_path(qemu.load_series()): True}
    assert len(trees) == 2
    for tree, built in trees.items():
        assert (f"ninja -C {tree}/build-" in err) == built
    assert err.count(f"tests/qtest/{qemu.MIGRATION_TEST}") == 1 + pristine


def fake_migration_test(monkeypatch, tmp_path, statuses: dict[str, dict[str, str]]) -> list[str]:
    """migration-test on fake builds: statuses[build][case]; returns the
    builds asked for, in order."""
    built: list[str] = []

    def build(shell, series=None, extra_patches=()):
        name = "pristine" if series is not None else "patched"
        built.append(name)
        out = tmp_path / name
        out.mkdir(exist_ok=True)
        return qemu.BuiltQemu(out, out / "qemu", name)

    def run(shell, b, binary, paths_, args=(), timeout_s=0):
        return [qemu.QtestCase(c, statuses[b.key].get(c, "failed"), "out") for c in paths_]

    monkeypatch.setattr(qemu, "build", build)
    monkeypatch.setattr(qemu, "build_qtest", lambda shell, b, name: b.out_dir / name)
    monkeypatch.setattr(qemu, "migration_test_cases",
                        lambda shell, b, binary: [*qemu.MIGRATION_TEST_CASES, "/own"])
    monkeypatch.setattr(qemu, "run_qtest_cases", run)
    return built


def test_migration_test_runs_pristine_qemu_only_for_what_the_patched_build_fails(
        monkeypatch, tmp_path):
    every = {c: "ok" for c in (*qemu.MIGRATION_TEST_CASES, "/own")}
    built = fake_migration_test(monkeypatch, tmp_path, {"patched": every, "pristine": {}})
    res = qemu.migration_test_stage(Shell())
    assert res.status == "ok" and built == ["patched"], res.detail
    assert "pristine not needed" in res.detail
    first = qemu.MIGRATION_TEST_CASES[0]
    # a case both builds fail is the host's; one only pristine passes is a regression
    for on_pristine, status in (("failed", "ok"), ("ok", "failed")):
        for f in tmp_path.glob("*/" + qemu.PRISTINE_PASSED):
            f.unlink()
        built = fake_migration_test(monkeypatch, tmp_path, {
            "patched": {**every, first: "failed"}, "pristine": {first: on_pristine}})
        res = qemu.migration_test_stage(Shell())
        assert built == ["patched", "pristine"]
        assert res.status == status, res.detail
        assert ("REGRESSION " + first in res.detail) == (status == "failed")


def test_migration_test_fails_on_a_case_only_the_pristine_build_passes():
    pristine = {"/a": "ok", "/b": "failed", "/c": "ok"}
    assert qemu.migration_test_compare(pristine, {"/a": "ok", "/b": "failed", "/c": "ok"}) == []
    # a case that fails on both is the host's, not the queue's
    assert qemu.migration_test_compare(pristine, {"/a": "ok", "/b": "ok", "/c": "ok"}) == []
    bad = qemu.migration_test_compare(pristine, {"/a": "ok", "/b": "failed", "/c": "failed"})
    assert len(bad) == 1 and bad[0].startswith("/c: failed on the patched build")


def test_migration_test_holds_the_queue_s_own_cases_to_passing():
    bad = qemu.migration_test_compare({"/a": "ok"}, {"/a": "ok", "/q": "skipped"})
    assert bad == ["/q: skipped (the queue's own case)"]


def test_migration_test_cases_touch_precopy_postcopy_multifd_and_zero_pages():
    cases = " ".join(qemu.MIGRATION_TEST_CASES)
    for what in ("precopy", "postcopy/plain", "postcopy/preempt", "multifd", "zero-page"):
        assert what in cases

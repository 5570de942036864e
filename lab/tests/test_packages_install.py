"""The Debian packages in a fresh Debian 12 root: they install beside
Debian's, and the packaged kernel boots under the packaged QEMU with the
balloon offering bits 6 and 7, reports, and reads the bits.

Slow: the packages come from `freepage package` (cached after the first
build), the root from mmdebstrap (cached tarball, unpacked afresh).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from freepage_lab import debroot, guestshell, harness, packages
from freepage_lab.backend import BalloonBackend
from freepage_lab.runners import GuestConfig, QemuRunner
from freepage_lab.scenarios import zeroskip
from freepage_lab.shell import Shell

pytestmark = pytest.mark.slow

PACKAGED_QEMU = Path("/usr/bin") / packages.QEMU_COMMAND


class ChrootQemu(QemuRunner):
    """The packaged QEMU, run inside the root it was installed into: its own
    firmware lookup (no -L), the packaged kernel, the lab's initramfs copied
    in. The mounts live in a mount namespace of the guest's own, so they go
    with it."""

    def __init__(self, shell: Shell, root: Path) -> None:
        super().__init__(shell, "tcg", PACKAGED_QEMU)
        self.root = root

    def inside(self, path: Path) -> Path:
        if not path.is_relative_to(self.root):
            dest = self.root / "tmp" / path.name
            shutil.copyfile(path, dest)
            path = dest
        return Path("/") / path.relative_to(self.root)

    def argv(self, cfg: GuestConfig) -> list[str]:
        cfg = replace(cfg, kernel=self.inside(cfg.kernel), initrd=self.inside(cfg.initrd))
        argv = super().argv(cfg)
        # the lab gives its build Debian's firmware with -L; the package finds it itself
        for i in reversed([i for i, a in enumerate(argv) if a == "-L"]):
            del argv[i:i + 2]
        mount = ('mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && '
                 'exec chroot "$0" "$@"')
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount,
                str(self.root), *argv]


class UnitDaemon(BalloonBackend):
    """vhost-user-balloon as the packaged unit starts it (its ExecStart, the
    instance name and /etc/default's arguments filled in), inside the root."""

    def __init__(self, root: Path, instance: str, log: Path) -> None:
        super().__init__(Shell(), root / "run" / "vhost-user-balloon" / f"{instance}.sock", log)
        self.root = root
        self.instance = instance

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)  # systemd's RuntimeDirectory
        super().start()

    def argv(self, exe: Path) -> list[str]:
        unit = (self.root / "lib" / "systemd" / "system" / packages.DAEMON_UNIT).read_text()
        start = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
        default = (self.root / "etc" / "default" / packages.DAEMON_PACKAGE).read_text()
        args = re.search(r'^VHOST_USER_BALLOON_ARGS="(.*)"$', default, re.M)
        assert args is not None, default
        words = start.removeprefix("ExecStart=").replace("%i", self.instance).split()
        words = [w for w in words if w != "$VHOST_USER_BALLOON_ARGS"] + args.group(1).split()
        return ["chroot", str(self.root), *words]


def built_debs(tmp_path: Path) -> list[Path]:
    results = packages.package_all(Shell(), tmp_path / "debs")
    assert all(r.ok for r in results), [r.detail for r in results if not r.ok]
    return sorted((tmp_path / "debs").glob("*.deb"))


def dpkg_owner(root: Path, path: str) -> str:
    out = Shell(quiet=True).run(["chroot", root, "dpkg", "-S", path], capture=True)
    return out.split(":")[0]


def said(booted: harness.Booted, what: str) -> list[str]:
    """The words after `what` on the guest's console line that starts with it."""
    line = next(t for t in booted.lines if t.startswith(what + " "))
    return line[len(what):].split()


def test_packages_install_beside_debian_and_the_guest_reads_the_bits(lab, tmp_path):
    debs = built_debs(tmp_path)
    root = debroot.install_root(Shell(), debs, tmp_path / "root")
    kernels = sorted((root / "boot").glob("vmlinuz-*-freepage"))
    assert len(kernels) == 1, kernels
    # beside Debian's, not in its place
    assert dpkg_owner(root, "/usr/bin/qemu-system-x86_64") == "qemu-system-x86"
    assert dpkg_owner(root, str(PACKAGED_QEMU)) == packages.QEMU_PACKAGE
    for path in ("/usr/bin/vhost-user-balloon", f"/lib/systemd/system/{packages.DAEMON_UNIT}",
                 "/usr/share/man/man8/vhost-user-balloon.8.gz"):
        assert dpkg_owner(root, path) == packages.DAEMON_PACKAGE, path

    # the daemon as its unit runs it: the experimental bits stay off (what it
    # offers is in its start-up line; get_counters says it once a front-end came)
    with UnitDaemon(root, "vm1", tmp_path / "daemon.log") as daemon:
        assert daemon.request({"cmd": "get_config"})["ok"]
    m = re.search(r"offered features (0x[0-9a-f]+)", daemon.log.read_text())
    assert m, daemon.log.read_text()
    offered = int(m.group(1), 16)
    bits = (guestshell.BIT_DEVICE_INIT_REPORTED, guestshell.BIT_DEVICE_INIT_ON_INFLATE)
    assert offered & (1 << 5), hex(offered)  # reporting
    assert not offered & sum(1 << b for b in bits), hex(offered)

    # the lab's never-zero-twice check: reported memory reads zero and its
    # clearing is skipped, on the packaged kernel and QEMU
    ctx = lab.context("qemu", patched=True, patched_qemu=True)
    params = zeroskip.ZeroskipParams(populate_mib=64, repeat=1)
    script = (f'echo "uname $(uname -r)"\necho "features {guestshell.BALLOON_FEATURES}"\n'
              + zeroskip.guest_script(params, ("4k",)) + guestshell.reporting_counters() + "\n")
    variant = harness.Variant("packaged", patched=True, zeroing=True)
    with lab.start(ctx, "packaged", script, variant, mem_mib=512, timeout_s=600,
                   run_with=ChrootQemu(Shell(), root), overrides={"kernel": kernels[0]}) as run:
        assert run.wait_exit() == 0
    booted = harness.check(run.booted)
    assert said(booted, "uname")[0].endswith(packages.KERNEL_LOCALVERSION)
    features = said(booted, "features")[0]
    assert [features[b] for b in bits] == ["1", "1"], features
    measured, vmstat = zeroskip.Zeroskip._guest(booted)
    assert measured and all(r["nonzero_bytes"] == 0 for r in measured), measured
    assert vmstat[-1]["pgzero_skipped"] > 0, vmstat
    # reported pages, per order
    assert sum(map(int, said(booted, f"{guestshell.COUNTER_TAG} reported_pages"))) > 0

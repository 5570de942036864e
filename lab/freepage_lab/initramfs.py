"""Guest user space: a busybox initramfs plus a per-run overlay carrying the script.

The kernel unpacks concatenated newc archives in order, so a run's script
is a tiny second archive appended to the shared base image.
"""

from __future__ import annotations

import hashlib
import io
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import paths, platforms
from .shell import LabError, Shell

BUSYBOX = Path("/bin/busybox")
GUEST_PROGS = ("populate", "dirty", "churn", "pagefault", "cachewalk", "hugefit",
               "hugecow", "fragment", "reuse", "fpkeep", "vmstart")

# Markers the host parses from the console.
BOOTED = "FREEPAGE-BOOTED"
EXIT = "FREEPAGE-EXIT"
EVENT = "FREEPAGE-EVENT"
# the kernel command line's root disk for the script (runners: GuestConfig.root_disk)
ROOT_ARG = "fp.root="

INIT = f"""#!/bin/sh
# freepage guest init: mount the basics, run /run.sh, report, halt.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -t tmpfs tmpfs /tmp
# debugfs where the kernel has it (free page reporting's counters and flush)
[ -d /sys/kernel/debug ] && mount -t debugfs debugfs /sys/kernel/debug
echo "{BOOTED} $(cut -d' ' -f1 /proc/uptime)"
rc=0
run="sh -e /run.sh"
# a root disk ({ROOT_ARG}<device>, platforms.Platform.root): the script runs
# in it, with this init's mounts and its programs under /freepage
for arg in $(cat /proc/cmdline); do
\tcase $arg in {ROOT_ARG}*) root=${{arg#{ROOT_ARG}}} ;; esac
done
if [ -n "$root" ] && [ -f /run.sh ]; then
\tif mount -t ext4 "$root" /mnt; then
\t\tfor d in proc sys dev tmp; do mount -o rbind /$d /mnt/$d; done
\t\tmount -o bind /bin /mnt/freepage
\t\tcp /run.sh /mnt/run.sh
\t\trun="chroot /mnt /usr/bin/env PATH=/usr/sbin:/usr/bin:/sbin:/bin:/freepage sh -e /run.sh"
\telse
\t\techo "{ROOT_ARG}$root: cannot mount it" >&2
\t\trun="false"
\tfi
fi
if [ -f /run.sh ]; then
\t$run
\trc=$?
fi
echo "{EXIT} $rc"
sync
case " $(cat /proc/cmdline) " in
*" fp.halt=reboot "*) reboot -f ;;
*) poweroff -f ;;
esac
"""


@dataclass
class Entry:
    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def newc(entries: list[Entry]) -> bytes:
    """Serialise entries as a newc ("070701") cpio archive with trailer."""
    out = io.BytesIO()

    def pad(n: int) -> None:
        out.write(b"\0" * ((4 - n % 4) % 4))

    for ino, e in enumerate([*entries, Entry("TRAILER!!!", 0)], start=1):
        name = e.name.encode() + b"\0"
        fields = [ino, e.mode, 0, 0, 1, 0, len(e.data), 0, 0, e.rdev[0], e.rdev[1], len(name), 0]
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        out.write(header + name)
        pad(len(header) + len(name))
        out.write(e.data)
        pad(len(e.data))
    return out.getvalue()


def _dir(name: str) -> Entry:
    return Entry(name, stat.S_IFDIR | 0o755)


def _programs(src: Path, names: Sequence[str], dest: str, missing: str) -> list[Entry]:
    """Executables src/<name> as dest/<basename>; `missing` names one that is not there."""
    out = []
    for name in names:
        path = src / name
        if not path.exists():
            raise LabError(missing.format(path))
        out.append(_file(f"{dest}/{Path(name).name}", path.read_bytes()))
    return out


def _file(name: str, data: bytes, mode: int = 0o755) -> Entry:
    return Entry(name, stat.S_IFREG | mode, data)


def base_entries(progs_dir: Path, busybox: Path = BUSYBOX) -> list[Entry]:
    if not busybox.exists():
        raise LabError(f"{busybox} missing: install busybox-static (`make deps`)")
    entries = [_dir(d) for d in ("bin", "dev", "proc", "sys", "tmp", "mnt", "etc")]
    entries.append(Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    entries.append(Entry("dev/null", stat.S_IFCHR | 0o666, rdev=(1, 3)))
    entries.append(_file("bin/busybox", busybox.read_bytes()))
    entries.append(Entry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"))
    entries.append(_file("init", INIT.encode()))
    entries += _programs(progs_dir, GUEST_PROGS, "bin", "guest program {} missing (make -C guest)")
    return entries


def build_guest_programs(shell: Shell, arch: str = "x86_64") -> Path:
    cross = platforms.arch(arch).cross_compile
    out = paths.cache_dir() / (f"guest-{arch}" if cross else "guest")
    argv: list[str | Path] = ["make", "-s", "-C", paths.GUEST_DIR, f"OUT={out}"]
    if cross:
        argv.append(f"CC={platforms.arch(arch).cc}")
    shell.run(argv, what=f"build guest programs ({arch})")
    return out


def debian_busybox(shell: Shell, package: str) -> Path:
    """A Debian busybox-static of another arch, downloaded and unpacked once
    (the package is not Multi-Arch: it cannot be installed beside the host's)."""
    deb_arch = package.split(":")[1]
    where = paths.cache_dir() / f"{deb_arch}-busybox"
    binary = where / "root" / "bin" / "busybox"
    if binary.exists():
        return binary
    where.mkdir(parents=True, exist_ok=True)
    shell.run(["apt-get", "download", package], cwd=where,
              what=f"download {package} (needs `dpkg --add-architecture {deb_arch}`)")
    debs = sorted(where.glob(f"busybox-static_*_{deb_arch}.deb"))
    if shell.dry_run:
        return binary
    if not debs:
        raise LabError(f"apt-get download {package} left no .deb in {where}")
    shell.run(["dpkg-deb", "-x", debs[-1], where / "root"], what=f"unpack {deb_arch} busybox")
    return binary


def selftest_entries(shell: Shell, name: str) -> list[Entry]:
    """A selftests suite (selftests.SUITES), built once, under /<name>
    (kvm's aarch64/page_fault_test -> /kvm/page_fault_test); none on a dry run."""
    from . import selftests

    suite = selftests.SUITES[name]
    directory = selftests.build(shell, suite)
    if shell.dry_run:
        return []
    return [_dir(name), *_programs(directory, suite.programs, name,
                                   f"{name} selftest {{}} missing")]


def base_image(shell: Shell, arch: str = "x86_64") -> Path:
    """The shared initramfs of an arch, rebuilt only when its content changes."""
    progs = build_guest_programs(shell, arch)
    extra: list[Entry] = []
    busybox = BUSYBOX
    desc = platforms.arch(arch)
    if desc.busybox_package:
        busybox = debian_busybox(shell, desc.busybox_package)
    for suite in desc.selftests:
        extra += selftest_entries(shell, suite)
    if shell.dry_run:
        return paths.cache_dir() / "initramfs" / f"base-{arch}-dry-run.cpio"
    data = newc(base_entries(progs, busybox) + extra)
    digest = hashlib.sha256(data).hexdigest()[:16]
    target = paths.cache_dir() / "initramfs" / f"base-{digest}.cpio"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(target)
    return target


def with_script(base: Path, script: str, dest: Path, extra: Sequence[Entry] = ()) -> Path:
    """base image + an overlay holding `extra` and /run.sh -> dest."""
    overlay = newc([*extra, _file("run.sh", script.encode())])
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(base.read_bytes() + overlay)
    return dest

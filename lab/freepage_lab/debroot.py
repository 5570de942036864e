"""A fresh Debian 12 root with freepage's packages installed (the install
and libvirt tests): mmdebstrap from the Debian mirror, cached by content.

    root = debroot.install_root(shell, debs, tmp_path / "root")

The root tarball (apt variant, with every package the .debs depend on
and Debian's qemu-system-x86, which ours installs beside) is made once
per (suite, sources, package list) under
`~/.cache/freepage/packages/debian-root-<key>/root.tar`; each test unpacks
it afresh and installs the .debs with dpkg, offline.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from . import buildcache
from .packages import cache_root
from .shell import Shell

DEBIAN_SUITE = "bookworm"
# Debian's qemu-system-x86 comes along (ours must install beside it), and
# libvirt's daemon and virsh (the libvirt test runs one daemon per root)
ROOT_EXTRA = ("qemu-system-x86", "libvirt-daemon", "libvirt-daemon-driver-qemu", "libvirt-clients")
# what Debian 12 has of QEMU and libvirt in backports (10.0, 11.3) wins,
# as `apt install -t bookworm-backports` would have it
DEFAULT_RELEASE = f"{DEBIAN_SUITE}-backports"


def debian_mirror() -> str:
    return os.environ.get("FREEPAGE_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def root_sources() -> list[str]:
    m = debian_mirror()
    return [f"deb {m} {DEBIAN_SUITE} main", f"deb {m} {DEBIAN_SUITE}-backports main"]


def depends_of(shell: Shell, debs: list[Path]) -> list[str]:
    """The packages `debs` depend on, without versions (first alternative),
    less the ones among `debs`."""
    names: set[str] = set()
    own = set()
    for deb in debs:
        fields = shell.run(["dpkg-deb", "-f", deb, "Package", "Depends"], capture=True,
                           what=f"dpkg-deb -f {deb.name}")
        for line in fields.splitlines():
            key, _, value = line.partition(":")
            if key == "Package":
                own.add(value.strip())
            elif key == "Depends":
                for dep in value.split(","):
                    name = dep.split("|")[0].strip().split(" ")[0].split(":")[0]
                    if name:
                        names.add(name)
    return sorted(names - own)


def debian_root(shell: Shell, include: list[str]) -> Path:
    """A Debian 12 root tarball (mmdebstrap, apt variant) with `include`
    installed from the Debian mirror, cached by (suite, sources, packages)."""
    include = sorted({*include, *ROOT_EXTRA})
    h = hashlib.sha256(f"{DEBIAN_SUITE}\0apt\0{DEFAULT_RELEASE}\0".encode())
    for part in (*root_sources(), *include):
        h.update(part.encode() + b"\0")
    key = h.hexdigest()[:16]
    out = cache_root() / f"debian-root-{key}"
    tar = out / "root.tar"

    def make(_src: Path, dest: Path) -> bool:
        shell.run(["nice", "-n", "5", "mmdebstrap", "--variant=apt", "--mode=root",
                   f'--aptopt=APT::Default-Release "{DEFAULT_RELEASE}"',
                   "--include=" + ",".join(include), DEBIAN_SUITE, dest / tar.name,
                   *root_sources()], log=dest / "mmdebstrap.log", what="mmdebstrap")
        return not shell.dry_run

    buildcache.build_once(shell, buildcache.Build("debian root", "root", out, tar,
                                                  cache_root() / f"debian-root-{key}.lock", tar),
                          lambda: out, make)
    return tar


def install_root(shell: Shell, debs: list[Path], dest: Path) -> Path:
    """A fresh Debian 12 root in `dest` with `debs` installed by dpkg (their
    dependencies came from the mirror with the cached root)."""
    tar = debian_root(shell, depends_of(shell, debs))
    if not shell.dry_run:
        dest.mkdir(parents=True)
    shell.run(["tar", "-C", dest, "-xf", tar], what="unpack the Debian root")
    inside = dest / "tmp" / "debs"
    if not shell.dry_run:
        inside.mkdir(parents=True)
        for deb in debs:
            shutil.copyfile(deb, inside / deb.name)
    shell.run(["chroot", dest, "dpkg", "-i", *(f"/tmp/debs/{d.name}" for d in debs)],
              log=dest.parent / f"{dest.name}-dpkg.log", what="dpkg -i in the Debian root")
    return dest

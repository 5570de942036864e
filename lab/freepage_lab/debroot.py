"""Debian 12 roots made by mmdebstrap from the Debian mirror, cached by content.

Two kinds:

* the root the install and libvirt tests install freepage's packages in:

      root = debroot.install_root(shell, debs, tmp_path / "root")

  The root tarball (apt variant, with every package the .debs depend on
  and Debian's qemu-system-x86, which ours installs beside) is made once
  per (suite, sources, package list) under
  `~/.cache/freepage/packages/debian-root-<key>/root.tar`; each test unpacks
  it afresh and installs the .debs with dpkg, offline.

* the Debian guest's root disk (the `qemu-debian` platform):

      image = debroot.guest_image(shell)

  a minbase root (`GUEST_ROOT`) as an ext4 image with room for a
  workload's files, under `~/.cache/freepage/debian/guest-<key>/root.ext4`.
  The guest boots the lab's initramfs, whose init mounts the disk and runs
  the script in it (initramfs.INIT); QEMU opens the image with
  snapshot=on, so no boot changes the cached file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import buildcache, paths
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


@dataclass(frozen=True)
class Root:
    """What mmdebstrap puts in one root: its variant and the packages it adds."""

    variant: str
    include: tuple[str, ...] = ()

    def key(self) -> str:
        h = hashlib.sha256(f"{DEBIAN_SUITE}\0{self.variant}\0{DEFAULT_RELEASE}\0".encode())
        for part in (*root_sources(), *self.include):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:16]


# The Debian guest: Debian's essential packages (coreutils' dd,
# util-linux), what the file I/O workload runs. No init system: the lab's
# initramfs init runs the script in this root.
GUEST_ROOT = Root("minbase")
# The same root with the tools the heavier workloads need: gcc, make and
# GNU time for the compile (compilejob), Debian's QEMU (qemu-system-x86,
# no Recommends) for the VM the guest starts itself (scenarios/vmcreate).
# A root of its own, so that a guest doing file I/O alone (the one make
# test boots) waits for no compiler or QEMU to be installed.
TOOLS_ROOT = Root("minbase", ("gcc", "make", "time", "qemu-system-x86"))
# free space on the guest's root disk for the workload's files, MiB
GUEST_FREE_MIB = 1024


def root_tarball(shell: Shell, root: Root, where: Path) -> Path:
    """`root` as a tarball in `where`/debian-root-<key>/root.tar (made once)."""
    key = root.key()
    out = where / f"debian-root-{key}"
    tar = out / "root.tar"

    def make(_src: Path, dest: Path) -> bool:
        shell.run(["nice", "-n", "5", "mmdebstrap", f"--variant={root.variant}", "--mode=root",
                   f'--aptopt=APT::Default-Release "{DEFAULT_RELEASE}"',
                   *(["--include=" + ",".join(root.include)] if root.include else []),
                   DEBIAN_SUITE, dest / tar.name, *root_sources()],
                  log=dest / "mmdebstrap.log", what="mmdebstrap")
        return not shell.dry_run

    buildcache.build_once(shell, buildcache.Build("debian root", "root", out, tar,
                                                  where / f"debian-root-{key}.lock", tar),
                          lambda: out, make)
    return tar


def debian_root(shell: Shell, include: list[str]) -> Path:
    """A Debian 12 root tarball (mmdebstrap, apt variant) with `include`
    installed from the Debian mirror, cached by (suite, sources, packages)."""
    return root_tarball(shell, Root("apt", tuple(sorted({*include, *ROOT_EXTRA}))), cache_root())


def guest_image(shell: Shell, root: Root = GUEST_ROOT, free_mib: int = GUEST_FREE_MIB,
                trees: Sequence[Path] = ()) -> Path:
    """`root` as an ext4 disk image with `free_mib` to spare, made once per
    (root, free space, trees); the guest's /freepage is where its init puts
    the initramfs' programs (busybox, guest/). `trees`: directories whose
    contents are copied to the image's / (each a cached build, its
    directory name carrying its content key)."""
    where = paths.cache_dir() / "debian"
    tar = root_tarball(shell, root, where)
    key = hashlib.sha256("\0".join([root.key(), "ext4", str(free_mib),
                                     *(str(t) for t in trees)]).encode()).hexdigest()[:16]
    out = where / f"guest-{key}"
    image = out / "root.ext4"

    def make(_src: Path, dest: Path) -> bool:
        tree = dest / "tree"
        if not shell.dry_run:
            tree.mkdir()
        shell.run(["tar", "-C", tree, "-xf", tar], what="unpack the Debian root")
        for extra in trees:
            shell.run(["cp", "-a", f"{extra}/.", tree], what=f"copy {extra.name} into the root")
        if not shell.dry_run:
            (tree / "freepage").mkdir(exist_ok=True)
        used_mib = 0 if shell.dry_run else tree_mib(tree)
        shell.run(["mke2fs", "-q", "-t", "ext4", "-L", "freepage-root", "-d", tree, image,
                   f"{used_mib + free_mib}M"], what="make the guest's root disk")
        shell.run(["rm", "-rf", tree], what="remove the unpacked root")
        return not shell.dry_run

    buildcache.build_once(shell, buildcache.Build("debian guest image", "image", out, image,
                                                  where / f"guest-{key}.lock", image),
                          lambda: out, make)
    return image


def tree_mib(tree: Path) -> int:
    """MiB the files under `tree` take, rounded up, plus a tenth for the
    file system's own blocks."""
    total = sum(p.lstat().st_size for p in tree.rglob("*"))
    mib = -(-total // (1 << 20))
    return mib + mib // 10 + 16


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

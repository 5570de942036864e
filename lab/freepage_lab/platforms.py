"""What the lab knows about each platform and kernel arch, as data.

A `Platform` is where a guest runs (UML, QEMU x86_64, QEMU arm64); an
`Arch` is the kernel it boots: how it is configured and cross-built, where
its image lands, what its initramfs carries. Scenarios ask these tables
(`platform(ctx.platform).thp`), not `if platform == ...`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shell import LabError


@dataclass(frozen=True)
class Arch:
    """A kernel arch (make ARCH=...)."""

    name: str
    # the boot image, relative to the build directory
    image: str
    # toolchain prefix of a cross build ("" = the host's gcc)
    cross_compile: str = ""
    # busybox-static from this Debian package ("" = the host's /bin/busybox)
    busybox_package: str = ""
    # selftests suites every initramfs of the arch carries (selftests.SUITES:
    # /kvm); others come with the runs that ask for them (harness.Plan)
    selftests: tuple[str, ...] = ()
    # the series kernel's command line that lets virtio-balloon take the
    # device's word on zeroed pages (bits 6 and 7 are opt-in in the guest)
    device_init_opt_in: tuple[str, ...] = ()
    # kernel/<this>/patches: what every kernel of the arch needs to run on
    # the lab's hosts, stock and series alike ("" = nothing)
    platform_series: str = ""

    @property
    def cc(self) -> str:
        return f"{self.cross_compile}gcc"


ARCHES: dict[str, Arch] = {a.name: a for a in (
    # platform/um: FP registers as large as the host's XSAVE area (AMX hosts)
    Arch("um", "linux", device_init_opt_in=("virtio_balloon.device_init=1",),
         platform_series="platform/um"),
    Arch("x86_64", "arch/x86/boot/bzImage",
         device_init_opt_in=("virtio_balloon.device_init=1",)),
    # Debian's busybox-static:arm64 is not Multi-Arch: unpacked from the .deb
    Arch("arm64", "arch/arm64/boot/Image", "aarch64-linux-gnu-",
         "busybox-static:arm64", selftests=("kvm",)),
)}


@dataclass(frozen=True)
class Platform:
    """Where a guest runs."""

    name: str
    arch: str
    # runners.RUNNERS key: how the command line is built
    runner: str
    # populate modes the guest's memory management offers
    populate_modes: tuple[str, ...]
    # the balloon's host side is vhost-user-balloon, a host process of its own
    balloon_daemon: bool = False
    # runs the build of the qemu/ series with --patched-qemu, whose balloon can
    # say it zeroes reported and inflated pages (bits 6 and 7)
    patched_qemu: bool = False
    # -icount value that makes guest time count instructions ("" = none)
    icount: str = ""
    # a one-line description for --help and errors
    about: str = ""
    # the guest's user space: "" the lab's busybox initramfs alone; "debian"
    # a Debian 12 root (debroot.guest_image) on a virtio-blk disk, which the
    # initramfs' init mounts and runs the script in
    root: str = ""

    @property
    def thp(self) -> bool:
        return "thp" in self.populate_modes

    @property
    def hugetlb(self) -> bool:
        return "hugetlb" in self.populate_modes


PLATFORMS: dict[str, Platform] = {p.name: p for p in (
    Platform("uml", "um", "uml", ("4k",), balloon_daemon=True,
             about="User-Mode Linux, native speed, vhost-user-balloon"),
    Platform("qemu", "x86_64", "qemu", ("4k", "thp", "hugetlb", "hugetlb-1g"), patched_qemu=True,
             icount="shift=0,sleep=off",
             about="QEMU x86_64 (TCG unless hardware KVM), virtio-balloon-pci"),
    # the same QEMU with a Debian guest: Debian's user space (coreutils,
    # page cache traffic from a real disk) under the lab's kernels and init
    Platform("qemu-debian", "x86_64", "qemu", ("4k", "thp", "hugetlb", "hugetlb-1g"),
             patched_qemu=True, icount="shift=0,sleep=off",
             about="QEMU x86_64 with a Debian 12 root on virtio-blk",
             root="debian"),
    Platform("arm64", "arm64", "arm64", ("4k", "thp", "hugetlb"), icount="shift=0",
             about="qemu-system-aarch64 with EL2: the guest runs KVM"),
)}


def platform(name: str) -> Platform:
    if name not in PLATFORMS:
        raise LabError(f"unknown platform {name!r}: choose one of {', '.join(PLATFORMS)}")
    return PLATFORMS[name]


def arch(name: str) -> Arch:
    if name not in ARCHES:
        raise LabError(f"unknown arch {name!r}; choose one of {', '.join(ARCHES)}")
    return ARCHES[name]

"""UML and QEMU behind one interface: build a command line, boot, measure footprint."""

from __future__ import annotations

import json
import os
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from .guest import Guest
from .initramfs import ROOT_ARG
from .platforms import PLATFORMS, platform
from .procfs import allocated_bytes, anon_huge_bytes, deleted_file, host_commit_limit_mib, rss_bytes
from .shell import LabError, Shell


@dataclass
class GuestConfig:
    """What a scenario asks of a guest, independent of the platform."""

    kernel: Path
    initrd: Path
    mem_mib: int = 2048
    cmdline: list[str] = field(default_factory=list)
    # virtio-balloon with free page reporting (QEMU) / vhost-user socket (UML)
    balloon: bool = True
    free_page_reporting: bool = True
    free_page_hint: bool = False
    # QEMU's balloon initializes reported / inflated pages and says so
    # (feature bits 6 / 7, proposed, not allocated; patched QEMU only)
    device_init_reported: bool = False
    device_init_on_inflate: bool = False
    # more properties of the balloon device ("free-page-reporting=off")
    balloon_props: list[str] = field(default_factory=list)
    # vhost-user-balloon daemon's socket: UML's virtio_uml device; under QEMU
    # vhost-user-balloon-pci in place of virtio-balloon, RAM in a shared memfd
    vhost_user_balloon: Path | None = None
    # QEMU: guest RAM in a shared memfd (memory-backend-memfd,share=on), as
    # vhost-user backends need; always so with vhost_user_balloon
    shared_memfd: bool = False
    qmp_socket: Path | None = None
    incoming: str | None = None
    cpu: str | None = None  # QEMU -cpu model; default max (TCG) / host (KVM)
    smp: int = 1  # vCPUs (QEMU); UML runs one
    # QEMU TCG: -icount shift=0, one guest instruction per virtual
    # nanosecond, so guest clocks count instructions (work, not time)
    icount: bool = False
    # QEMU: NUMA nodes; the memory split evenly, the vCPUs in contiguous
    # runs (nodes beyond the vCPUs have memory only)
    numa_nodes: int = 1
    extra_args: list[str] = field(default_factory=list)
    # UML only: run the guest (every host process of it) on this host CPU
    host_cpu: int | None = None
    # QEMU x86_64: a root disk (raw image) on virtio-blk, opened with
    # snapshot=on (the image stays as it is); the initramfs' init runs the
    # script in it (initramfs.ROOT_ARG)
    root_disk: Path | None = None
    # root_disk is a qcow2 overlay of this boot's own, opened writable
    # without snapshot=on: the two ends of a migration share it, as they
    # would share storage (qcow2_overlay())
    root_shared: bool = False


# QEMU device property names, in one place: a renamed property is a
# one-line change here (GuestConfig field -> property)
BALLOON_PROPERTIES = {
    "free_page_reporting": "free-page-reporting",
    # feature bits 6 and 7 (qemu/device-init): experimental (x-) while the
    # virtio spec has not allocated the bits, whose numbers may change
    "device_init_reported": "x-device-init-reported",
    "device_init_on_inflate": "x-device-init-on-inflate",
}
HINT_PROPERTY = "free-page-hint"
IOTHREAD_PROPERTY = "iothread"
# the balloon's front-end for a vhost-user backend (qemu/device-init): virtio
# id 5, its queues and config fixed by QEMU
VHOST_USER_DEVICE = "vhost-user-balloon-pci,chardev={chardev}"


def balloon_device(driver: str, cfg: GuestConfig) -> str:
    """-device value of a virtio balloon with the properties `cfg` turns on."""
    dev = f"{driver},id=balloon0"
    for field_name, prop in BALLOON_PROPERTIES.items():
        if getattr(cfg, field_name):
            dev += f",{prop}=on"
    if cfg.free_page_hint:
        dev += f",{HINT_PROPERTY}=on,{IOTHREAD_PROPERTY}=balloon-io"
    return ",".join([dev, *cfg.balloon_props])


class Runner(ABC):
    name: str

    def __init__(self, shell: Shell) -> None:
        self.shell = shell

    @abstractmethod
    def argv(self, cfg: GuestConfig) -> list[str]: ...

    @abstractmethod
    def footprint_bytes(self, guest: Guest) -> int | None:
        """Host memory the guest's RAM costs right now (None: guest gone)."""

    def huge_backing_bytes(self, guest: Guest) -> int | None:
        """Of the footprint, how much the host backs with transparent huge
        pages (None: not measurable on this platform, or guest gone)."""
        return None

    def guest(self, name: str, cfg: GuestConfig, log: Path, interactive: bool = False) -> Guest:
        return Guest(name, self.argv(cfg), log, self.shell, interactive=interactive)


class UmlRunner(Runner):
    """User-Mode Linux: the kernel is a host process; RAM is a (deleted) shared file."""

    name = "uml"

    def argv(self, cfg: GuestConfig) -> list[str]:
        if cfg.numa_nodes > 1:
            raise LabError("UML has one memory node: NUMA nodes need --platform qemu")
        if cfg.root_disk is not None:
            raise LabError("a root disk is a QEMU x86_64 option (--platform qemu-debian)")
        argv = [str(cfg.kernel), f"mem={cfg.mem_mib}M", f"initrd={cfg.initrd}",
                "con=null", "con0=null,fd:1", "console=tty0", "fp.halt=poweroff"]
        if cfg.vhost_user_balloon is not None:
            argv.append(f"virtio_uml.device={cfg.vhost_user_balloon}:5")
        # taskset execs the kernel: the guest's pid stays the kernel's
        pin = ["taskset", "-c", str(cfg.host_cpu)] if cfg.host_cpu is not None else []
        return pin + argv + cfg.cmdline + cfg.extra_args

    def footprint_bytes(self, guest: Guest) -> int | None:
        """Allocated blocks of UML's physical-memory file (held open, unlinked)."""
        return allocated_bytes(deleted_file(guest.pid))


def kvm_usable() -> tuple[bool, str]:
    """Hardware KVM only: PVM (software nested virtualisation) does not boot stock Linux."""
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return False, "/dev/kvm is PVM (kvm_pvm loaded), which does not run stock Linux guests"
    if not any(os.path.isdir(f"/sys/module/{m}") for m in ("kvm_intel", "kvm_amd")):
        return False, "/dev/kvm present but neither kvm_intel nor kvm_amd is loaded"
    return True, "hardware KVM"


# the root disk as the guest sees it: the only virtio-blk device
ROOT_DEVICE = "/dev/vda"
# Debian's qemu-system-x86 (bookworm-backports: QEMU 10.0), found on PATH
STOCK_QEMU = Path("qemu-system-x86_64")
# A QEMU built from the +ds tarball has no firmware: it runs with Debian's
# (option ROMs, SeaBIOS, iPXE), given with -L (a configured --firmwarepath
# would be relocated into the build's qemu-bundle/)
QEMU_FIRMWARE_DIRS = (Path("/usr/share/qemu"), Path("/usr/share/seabios"),
                      Path("/usr/lib/ipxe/qemu"))
# the properties of the proposed feature bits 6 and 7 alone
BALLOON_INIT_PROPS = {k: v for k, v in BALLOON_PROPERTIES.items() if k != "free_page_reporting"}


def reserves_ram(mem_mib: int, commit_limit_mib: int) -> bool:
    """Whether guest RAM can be an ordinary mapping, whose size the host
    reserves up front. A guest larger than the host's RAM plus swap cannot:
    the heuristic overcommit refuses the mapping, so its RAM becomes a
    memory-backend-ram with reserve=off (MAP_NORESERVE). Either way the
    host backs only the pages the guest touches."""
    return mem_mib <= commit_limit_mib


# the guest kernel's struct pages: 64 bytes per 4 KiB page, written at boot
MEMMAP_SHARE = 64 / 4096
# what a guest costs the host besides its memmap and the memory it writes
# (QEMU itself, the guest kernel and its initramfs), MiB
GUEST_OVERHEAD_MIB = 512


def host_backing_mib(mem_mib: int, written_mib: int) -> int:
    """About the most a QEMU guest of `mem_mib` that writes `written_mib`
    of its memory makes the host back: its memmap, what it writes and the
    rest; the memory it never touches costs nothing."""
    return int(mem_mib * MEMMAP_SHARE) + written_mib + GUEST_OVERHEAD_MIB


def check_host_room(who: str, guests: list[tuple[int, int]], available_mib: int) -> None:
    """Refuses guests (mem_mib, written_mib each) that would run at once
    and together need more than the host's `available_mib`."""
    need = sum(host_backing_mib(m, w) for m, w in guests)
    if need > available_mib:
        mem, written = max(guests)
        raise LabError(
            f"{who}: {len(guests)} guest(s) of up to {mem // 1024} GiB need about {need} MiB "
            f"of the host (each: memmap {int(mem * MEMMAP_SHARE)} MiB, {written} MiB written, "
            f"{GUEST_OVERHEAD_MIB} MiB besides); the host has {available_mib} MiB available")


def ram_backend(size_mib: int, reserve: bool) -> str:
    """A private anonymous RAM backend (-object value, without its id)."""
    return f"memory-backend-ram,size={size_mib}M" + ("" if reserve else ",reserve=off")


def numa_args(cfg: GuestConfig, shared_memfd: bool, reserve: bool = True) -> list[str]:
    """`cfg.numa_nodes` NUMA nodes, each with its share of the memory in its
    own backend (a shared memfd where a vhost-user daemon maps guest RAM;
    `reserve` False: reserve=off, reserves_ram()) and a contiguous run of
    the vCPUs; nodes past the last vCPU get none."""
    nodes, smp = cfg.numa_nodes, cfg.smp
    if cfg.mem_mib % nodes:
        raise LabError(f"{cfg.mem_mib} MiB do not split evenly over {nodes} NUMA nodes")
    size = cfg.mem_mib // nodes
    backend = (f"memory-backend-memfd,size={size}M,share=on" if shared_memfd
               else ram_backend(size, reserve))
    per_node = -(-smp // nodes)  # ceiling: every vCPU in some node
    argv: list[str] = []
    for n in range(nodes):
        node = f"node,nodeid={n},memdev=ram{n}"
        first, last = n * per_node, min((n + 1) * per_node, smp) - 1
        if first <= last:
            node += f",cpus={first}-{last}"
        argv += ["-object", f"{backend},id=ram{n}", "-numa", node]
    return argv


class QemuRunner(Runner):
    """QEMU x86_64, TCG unless hardware KVM really works.

    `binary`: Debian's QEMU (the stock baseline) or a build of the qemu/ series
    (freepage variants; given Debian's firmware directories with -L).
    `commit_limit_mib`: the host's RAM plus swap (reserves_ram(); read from
    /proc/meminfo unless given).
    """

    name = "qemu"

    def __init__(self, shell: Shell, accel: str = "auto", binary: Path = STOCK_QEMU,
                 commit_limit_mib: int | None = None) -> None:
        super().__init__(shell)
        self.binary = binary
        self.commit_limit_mib = (host_commit_limit_mib() if commit_limit_mib is None
                                 else commit_limit_mib)
        if accel == "auto":
            ok, why = kvm_usable()
            accel = "kvm" if ok else "tcg"
            self.accel_reason = why
        elif accel == "kvm":
            ok, why = kvm_usable()
            if not ok:
                raise LabError(f"--accel kvm refused: {why}")
            self.accel_reason = why
        else:
            self.accel_reason = "asked for"
        self.accel = accel

    def argv(self, cfg: GuestConfig) -> list[str]:
        root = [f"{ROOT_ARG}{ROOT_DEVICE}"] if cfg.root_disk is not None else []
        append = " ".join(["console=ttyS0", "panic=-1", "fp.halt=reboot", "quiet",
                           "loglevel=4", *root, *cfg.cmdline])
        machine = f"pc,accel={self.accel}"
        # a vhost-user daemon maps guest RAM: it must be a shared file
        shared_memfd = cfg.shared_memfd or cfg.vhost_user_balloon is not None
        reserve = reserves_ram(cfg.mem_mib, self.commit_limit_mib)
        if (shared_memfd or not reserve) and cfg.numa_nodes == 1:
            machine += ",memory-backend=mem"
        argv = [str(self.binary), "-machine", machine,
                "-cpu", cfg.cpu or ("max" if self.accel == "tcg" else "host"), "-smp", str(cfg.smp),
                "-m", f"{cfg.mem_mib}M", "-kernel", str(cfg.kernel), "-initrd", str(cfg.initrd),
                "-append", append, "-display", "none", "-monitor", "none",
                "-serial", "stdio", "-no-reboot", "-nodefaults"]
        if self.binary != STOCK_QEMU:
            for d in QEMU_FIRMWARE_DIRS:
                argv += ["-L", str(d)]
        if cfg.numa_nodes > 1:
            argv += numa_args(cfg, shared_memfd, reserve)
        elif shared_memfd:
            argv += ["-object", f"memory-backend-memfd,id=mem,size={cfg.mem_mib}M,share=on"]
        elif not reserve:
            argv += ["-object", f"{ram_backend(cfg.mem_mib, reserve)},id=mem"]
        if cfg.vhost_user_balloon is not None:
            argv += self.vhost_user_balloon_args(cfg)
        elif cfg.balloon:
            argv += self.balloon_args(cfg)
        if cfg.root_disk is not None:
            argv += self.root_disk_args(cfg.root_disk, cfg.root_shared)
        if cfg.qmp_socket is not None:
            argv += ["-qmp", f"unix:{cfg.qmp_socket},server=on,wait=off"]
        if cfg.incoming is not None:
            argv += ["-incoming", cfg.incoming]
        return argv + cfg.extra_args + (["-icount", PLATFORMS["qemu"].icount] if cfg.icount else [])

    @staticmethod
    def root_disk_args(image: Path, shared: bool = False) -> list[str]:
        """The root disk on virtio-blk: the guest's first disk (ROOT_DEVICE);
        its writes go to a temporary overlay, never to the image, or with
        `shared` to `image` itself, a qcow2 overlay (qcow2_overlay())."""
        drive = (f"file={image},if=none,id=root,format=qcow2" if shared
                 else f"file={image},if=none,id=root,format=raw,snapshot=on")
        return ["-drive", drive, "-device", "virtio-blk-pci,drive=root"]

    @staticmethod
    def balloon_args(cfg: GuestConfig) -> list[str]:
        argv = ["-object", "iothread,id=balloon-io"] if cfg.free_page_hint else []
        return argv + ["-device", balloon_device("virtio-balloon-pci", cfg)]

    @staticmethod
    def vhost_user_balloon_args(cfg: GuestConfig) -> list[str]:
        """vhost-user-balloon-pci (qemu/device-init): the balloon's front-end for a
        vhost-user backend (virtio id 5, its queues and config fixed by QEMU)."""
        return ["-chardev", f"socket,id=vub,path={cfg.vhost_user_balloon}",
                "-device", VHOST_USER_DEVICE.format(chardev="vub")]

    def footprint_bytes(self, guest: Guest) -> int | None:
        return rss_bytes(guest.pid)

    def huge_backing_bytes(self, guest: Guest) -> int | None:
        """Guest RAM is QEMU's anonymous memory: its THP-backed part."""
        return anon_huge_bytes(guest.pid)


def qcow2_overlay(shell: Shell, image: Path, overlay: Path) -> Path:
    """A qcow2 overlay on the raw `image` (which stays as it is): the
    root disk a migration's source and destination share."""
    shell.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", image, overlay],
              what="a root disk overlay")
    return overlay


class Arm64Runner(Runner):
    """qemu-system-aarch64 (TCG) with EL2, so the guest kernel runs KVM for real.

    `-M virt,virtualization=on` gives the guest EL2: its kernel initialises
    KVM in VHE mode, or nVHE with `kvm-arm.mode=nvhe` on the command line,
    and runs nested guests (the KVM selftests) under emulation.
    """

    name = "arm64"

    def __init__(self, shell: Shell, accel: str = "tcg") -> None:
        super().__init__(shell)
        if accel == "kvm":
            raise LabError("--accel kvm refused: the arm64 platform is emulated (TCG) on this host")
        self.accel = "tcg"
        self.accel_reason = "arm64 guests are emulated"

    def argv(self, cfg: GuestConfig) -> list[str]:
        if cfg.numa_nodes > 1 or cfg.root_disk is not None:
            raise LabError("NUMA nodes and root disks are QEMU x86_64 options "
                           "(--platform qemu, qemu-debian)")
        append = " ".join(["console=ttyAMA0", "panic=-1", "fp.halt=reboot", "quiet",
                           "loglevel=4", *cfg.cmdline])
        argv = ["qemu-system-aarch64", "-machine", "virt,virtualization=on,gic-version=3",
                "-accel", "tcg", "-cpu", cfg.cpu or "max", "-smp", str(cfg.smp),
                "-m", f"{cfg.mem_mib}M", "-kernel", str(cfg.kernel), "-initrd", str(cfg.initrd),
                "-append", append, "-display", "none", "-monitor", "none",
                "-serial", "stdio", "-no-reboot", "-nodefaults"]
        if cfg.icount:
            argv += ["-icount", PLATFORMS["arm64"].icount]
        if cfg.balloon:
            argv += ["-device", balloon_device("virtio-balloon-device", cfg)]
        if cfg.qmp_socket is not None:
            argv += ["-qmp", f"unix:{cfg.qmp_socket},server=on,wait=off"]
        return argv + cfg.extra_args

    def footprint_bytes(self, guest: Guest) -> int | None:
        return rss_bytes(guest.pid)


def make_runner(name: str, shell: Shell, accel: str = "auto",
                qemu_binary: Path = STOCK_QEMU) -> Runner:
    kind = platform(name).runner
    if kind == "uml":
        return UmlRunner(shell)
    if kind == "qemu":
        return QemuRunner(shell, accel, qemu_binary)
    return Arm64Runner(shell, "tcg" if accel == "auto" else accel)


class Qmp:
    """Minimal QMP client: one command at a time, events kept aside."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(str(path))
                break
            except OSError as exc:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise LabError(f"QMP socket {path} did not come up: {exc}") from exc
                time.sleep(0.1)
        self.sock.settimeout(timeout)
        self.file = self.sock.makefile("rwb")
        self.events: list[dict] = []
        self._read()  # greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict:
        try:
            line = self.file.readline()
        except OSError as exc:
            raise LabError(f"QMP: connection lost ({exc})") from exc
        if not line:
            raise LabError("QMP connection closed")
        return json.loads(line)

    def execute(self, command: str, **arguments: object) -> object:
        msg: dict[str, object] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        try:
            self.file.write(json.dumps(msg).encode() + b"\n")
            self.file.flush()
        except OSError as exc:
            raise LabError(f"QMP {command}: connection lost ({exc}); did QEMU exit?") from exc
        while True:
            reply = self._read()
            if "event" in reply:
                self.events.append(reply)
                continue
            if "error" in reply:
                raise LabError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass

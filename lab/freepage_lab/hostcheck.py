"""What the host offers the lab's guests, checked before anything boots.

UML runs each guest process under the host's ptrace and maps its RAM from a
temporary file with PROT_EXEC; QEMU guests run under TCG unless the host has
hardware KVM. The size of the host's XSAVE area decides whether a UML kernel
can hand a process's FP registers back: stock 6.12 passes a buffer fixed at
build time, which hosts with AMX refuse (kernel/platform/um sizes it from
the host instead). `freepage host` prints every finding in one line each,
and fails with the reason when a guest cannot run here.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import platform as pyplatform
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import kernel
from .runners import kvm_usable

# arch/x86/um/user-offsets.c of 6.12: HOST_FP_SIZE, the bytes UML hands
# PTRACE_SETREGSET; the host's xstateregs_set() refuses fewer than its area
UML_6_12_FP_BYTES = 2696
# the flags that decide the XSAVE area's size (and so UML's fate)
FLAGS = ("xsave", "avx", "avx512f", "pku", "amx_tile", "amx_int8", "amx_bf16")

PTRACE_TRACEME = 0
PTRACE_GETREGSET = 0x4204
NT_X86_XSTATE = 0x202


@dataclass
class HostFacts:
    cpu_model: str
    machine: str
    cpus: int
    flags: dict[str, bool]
    # bytes PTRACE_GETREGSET(NT_X86_XSTATE) fills: the host's XSAVE area
    xstate_bytes: int | None
    # why the ptrace probe failed ("" when it worked)
    ptrace_error: str
    # the directory UML maps its RAM file from, and why PROT_EXEC fails there
    uml_tmpdir: str
    uml_tmpdir_error: str
    kvm: bool
    kvm_why: str
    qemu: dict[str, str] = field(default_factory=dict)

    @property
    def uml_platform_fix(self) -> bool:
        """The lab's UML kernels size the FP registers from the host."""
        return "um" in kernel.PLATFORM_QUEUES and bool(
            kernel.with_platform("um", kernel.Series.empty()).names)

    @property
    def stock_uml_fails(self) -> bool:
        """An unpatched 6.12 UML dies at its first user process here."""
        return self.xstate_bytes is not None and self.xstate_bytes > UML_6_12_FP_BYTES

    def problems(self) -> list[str]:
        """What keeps the lab's guests from running here, one line each."""
        out = []
        if self.ptrace_error:
            out.append(f"UML cannot run: ptrace of a child fails ({self.ptrace_error})")
        if self.uml_tmpdir_error:
            out.append(f"UML cannot run: {self.uml_tmpdir} does not allow PROT_EXEC mappings "
                       f"({self.uml_tmpdir_error}); set TMPDIR to a directory that does")
        if self.stock_uml_fails and not self.uml_platform_fix:
            out.append(f"UML cannot run: the host's XSAVE area is {self.xstate_bytes} bytes, "
                       f"6.12 UML passes {UML_6_12_FP_BYTES} (kernel/platform/um is missing)")
        for binary in ("qemu-system-x86_64", "qemu-system-aarch64"):
            if binary not in self.qemu:
                out.append(f"{binary} not found: run `make deps`")
        return out

    def lines(self) -> list[str]:
        have = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in self.flags.items())
        out = [f"host: {self.cpu_model} ({self.machine}, {self.cpus} CPUs)",
               f"  cpu flags: {have}"]
        if self.xstate_bytes is None:
            out.append("  ptrace XSAVE area: " + (f"not measured ({self.ptrace_error})"
                                                  if self.ptrace_error else "none (no XSAVE)"))
        else:
            fate = (f"more than the {UML_6_12_FP_BYTES} stock 6.12 UML passes: it fails here "
                    f"(EFAULT); the lab's UML kernels "
                    + ("carry kernel/platform/um, which sizes it from the host"
                       if self.uml_platform_fix else "lack kernel/platform/um")
                    if self.stock_uml_fails else
                    f"within the {UML_6_12_FP_BYTES} stock 6.12 UML passes")
            out.append(f"  ptrace XSAVE area: {self.xstate_bytes} bytes, {fate}")
        out.append(f"  ptrace: {'refused: ' + self.ptrace_error if self.ptrace_error else 'works'}")
        out.append(f"  UML memory file in {self.uml_tmpdir}: "
                   + (f"no PROT_EXEC ({self.uml_tmpdir_error})" if self.uml_tmpdir_error
                      else "PROT_EXEC works"))
        out.append(f"  KVM: {'yes' if self.kvm else 'no'} ({self.kvm_why}); "
                   + ("QEMU x86 guests may use it" if self.kvm else "QEMU guests run under TCG"))
        for binary in ("qemu-system-x86_64", "qemu-system-aarch64"):
            out.append(f"  {binary}: {self.qemu.get(binary, 'not found')}")
        return out

    def to_json(self) -> dict:
        data = asdict(self)
        data["xstate_bytes_stock_uml"] = UML_6_12_FP_BYTES
        data["stock_uml_fails"] = self.stock_uml_fails
        return data


def parse_cpuinfo(text: str) -> tuple[str, int, dict[str, bool]]:
    """(model name, processors, FLAGS present) of /proc/cpuinfo's text."""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    cpus = len(re.findall(r"^processor\s*:", text, re.M))
    return (model.group(1).strip() if model else "unknown"), cpus, {f: f in have for f in FLAGS}


def ptrace_xstate_bytes() -> tuple[int | None, str]:
    """The host's XSAVE area as its ptrace hands it over, measured as UML
    does at start-up: PTRACE_GETREGSET writes back how much it filled, so
    offer more until some is left over. (None, "") where the host has no
    XSAVE regset; (None, why) where ptrace itself fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)

    class Iovec(ctypes.Structure):
        _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))

    pid = os.fork()
    if pid == 0:  # the child: be traced, stop, wait to be killed
        try:
            if libc.ptrace(PTRACE_TRACEME, 0, None, None) == 0:
                os.kill(os.getpid(), signal.SIGSTOP)
        finally:
            os._exit(0)
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            return None, "PTRACE_TRACEME refused"
        size = 4096
        while size <= 1 << 20:
            buf = ctypes.create_string_buffer(size)
            iov = Iovec(ctypes.addressof(buf), size)
            if libc.ptrace(PTRACE_GETREGSET, pid, ctypes.c_void_p(NT_X86_XSTATE),
                           ctypes.byref(iov)) != 0:
                err = ctypes.get_errno()
                if err in (errno.EINVAL, errno.ENODEV, errno.EIO):
                    return None, ""
                return None, f"PTRACE_GETREGSET: {os.strerror(err)}"
            if iov.len < size:
                return int(iov.len), ""
            size *= 2
        return None, ""
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def uml_tmpdir() -> Path:
    """Where 6.12 UML creates its RAM file (arch/um/os-Linux/mem.c)."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def exec_mapping_error(directory: Path) -> str:
    """Why a file in `directory` cannot be mapped PROT_EXEC ("" if it can)."""
    try:
        with tempfile.TemporaryFile(dir=directory) as fh:
            fh.truncate(mmap.PAGESIZE)
            mmap.mmap(fh.fileno(), mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def qemu_versions() -> dict[str, str]:
    out = {}
    for binary in ("qemu-system-x86_64", "qemu-system-aarch64"):
        path = shutil.which(binary)
        if path is None:
            continue
        try:
            first = subprocess.run([path, "--version"], capture_output=True, text=True,
                                   timeout=30).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out[binary] = f"{path} (--version failed: {exc})"
            continue
        out[binary] = f"{path}: {first[0] if first else '?'}"
    return out


def facts(cpuinfo: str | None = None) -> HostFacts:
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    model, cpus, flags = parse_cpuinfo(text)
    machine = pyplatform.machine()
    xstate, ptrace_error = ptrace_xstate_bytes() if machine == "x86_64" else (None, "")
    tmp = uml_tmpdir()
    kvm, kvm_why = kvm_usable()
    return HostFacts(model, machine, cpus or os.cpu_count() or 0, flags, xstate, ptrace_error,
                     str(tmp), exec_mapping_error(tmp), kvm, kvm_why, qemu_versions())


def save(path: Path, host: HostFacts) -> None:
    path.write_text(json.dumps(host.to_json(), indent=2, sort_keys=True) + "\n")

"""Where the allocator fast path and a page-fault loop spend their instructions.

`freepage trace` boots the x86_64 benchmark kernels (stock and the series,
both with kernel/bench/page-zeroed-bench.patch and bench.config) under QEMU
TCG with the gdb stub, stops in the benchmark's order-0 alloc+free loop,
single-steps a few iterations and charges every executed instruction to the
function it belongs to (nm). The count of an iteration is exact; between
boots the per-cpu list state can move it by an instruction or two. Where
`zerobench --platform qemu` says how many instructions an alloc+free pair
costs, this says which functions they are in.

The gdb stub steps with interrupts and timers masked (QEMU's default), so
no interrupt lands in the trace.

`freepage trace --loop fault` answers the same question for a whole
workload: the churn program's {mmap 512 MiB, write every 4 KiB page,
munmap} loop, the same benchmark kernels, no benchmark patch. A QEMU TCG
plugin (lab/qemu-plugin/blockcount.c) counts how often every translation
block ran; each block's instructions go to the function it starts in.
Each kernel boots twice, with a short and a long loop, and the difference
divided by the difference in page faults is what one fault of the loop
costs, settling subtracted out; the plugin starts counting when the guest
first runs user space, so the kernel's boot (whose clock calibration loops
run as long as the host lets them) stays out. Interrupts and the timer
are in it, as in the loop. Under -icount every iteration of a `rep stos`
is counted, so clearing a 4 KiB page with `rep stosb` is 4096 of them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from . import qemu as qemu_mod
from .shell import LabError, Shell

# the loop of bench_pairs() calls this once per iteration: the anchor
ANCHOR = "__free_pages"
LOOP = "bench_pairs"
GUEST_SCRIPT = (
    "echo 'fastpath 4096' > /sys/module/page_zeroed_bench/parameters/run\n"
)

GDB_SCRIPT = """\
import gdb

def trace(port, out, warm, steps):
    gdb.execute("set pagination off")
    gdb.execute("target remote 127.0.0.1:" + str(port))
    gdb.execute("hbreak LOOP")
    gdb.execute("continue")
    gdb.execute("delete")
    gdb.execute("hbreak ANCHOR")
    for _ in range(warm):
        gdb.execute("continue", to_string=True)
    gdb.execute("delete")
    with open(out, "w") as f:
        for _ in range(steps):
            pc = int(gdb.parse_and_eval("$pc")) & 0xffffffffffffffff
            f.write(format(pc, "x") + "\\n")
            gdb.execute("stepi", to_string=True)
""".replace("LOOP", LOOP).replace("ANCHOR", ANCHOR)


@dataclass
class Symbols:
    """Text symbols of a vmlinux, sorted by address."""

    addrs: list[int]
    names: list[str]

    @classmethod
    def parse(cls, nm_output: str) -> Symbols:
        pairs = []
        for line in nm_output.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] in ("t", "T", "w", "W"):
                pairs.append((int(parts[0], 16), parts[2]))
        pairs.sort()
        return cls([a for a, _ in pairs], [n for _, n in pairs])

    @classmethod
    def of(cls, vmlinux: Path) -> Symbols:
        out = subprocess.run(["nm", "-n", str(vmlinux)], capture_output=True, text=True)
        if out.returncode != 0:
            raise LabError(f"trace: nm {vmlinux} failed: {out.stderr.strip()}")
        return cls.parse(out.stdout)

    def address(self, name: str) -> int:
        try:
            return self.addrs[self.names.index(name)]
        except ValueError:
            raise LabError(f"trace: no symbol {name} (kernel without the benchmark patch?)") from None

    def name(self, pc: int) -> str:
        i = bisect.bisect_right(self.addrs, pc) - 1
        return self.names[i] if i >= 0 else "?"


@dataclass
class Iteration:
    """The instructions of one loop iteration, per function in first-run order."""

    total: int
    functions: dict[str, int] = field(default_factory=dict)
    # the length of every iteration traced, to show how steady they were
    lengths: list[int] = field(default_factory=list)


def one_iteration(pcs: list[int], syms: Symbols, anchor: str = ANCHOR) -> Iteration:
    """Count one iteration between two entries of `anchor`.

    The allocator's per-cpu bookkeeping (free_count, high) makes a branch go
    the other way now and then, so iterations may differ by a few
    instructions: the steady state is the length most iterations have, and
    at least two must have it.
    """
    start = syms.address(anchor)
    hits = [i for i, pc in enumerate(pcs) if pc == start]
    if len(hits) < 3:
        raise LabError(f"trace: {anchor} entered {len(hits)} times in {len(pcs)} steps; "
                       "need 3 (more steps?)")
    lengths = [b - a for a, b in zip(hits, hits[1:])]
    length, count = Counter(lengths).most_common(1)[0]
    if count < 2:
        raise LabError(f"trace: no two iterations alike {lengths}; not a steady state "
                       "(more steps?)")
    first = hits[lengths.index(length)]
    counts: Counter[str] = Counter()
    order: list[str] = []
    for pc in pcs[first:first + length]:
        name = syms.name(pc)
        if name not in counts:
            order.append(name)
        counts[name] += 1
    return Iteration(length, {n: counts[n] for n in order}, lengths)


def tcg_argv(image: Path, initrd: Path, mem_mib: int, console: Path, cmdline: str,
             extra: list[str]) -> list[str]:
    """One vCPU under TCG, console to a file, KASLR off so that the
    vmlinux's symbols name the addresses; `extra`: more QEMU arguments."""
    append = " ".join(w for w in ("console=ttyS0 panic=-1", cmdline, "nokaslr quiet loglevel=4")
                      if w)
    return ["qemu-system-x86_64", "-machine", "pc,accel=tcg", "-cpu", "max", "-smp", "1",
            "-m", f"{mem_mib}M", "-kernel", str(image), "-initrd", str(initrd),
            "-append", append, "-display", "none", "-monitor", "none", "-nodefaults",
            "-no-reboot", "-serial", f"file:{console}", *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trace_kernel(shell: Shell, build_dir: Path, initrd: Path, work: Path,
                 steps: int = 2000, warm: int = 64, timeout_s: float = 600) -> list[int]:
    """Executed PCs of `steps` instructions of the benchmark loop."""
    image = build_dir / "arch" / "x86" / "boot" / "bzImage"
    vmlinux = build_dir / "vmlinux"
    port = _free_port()
    script = work / "trace_gdb.py"
    out = work / "pcs.txt"
    qemu = tcg_argv(image, initrd, 512, work / "console.log", "",
                    ["-S", "-gdb", f"tcp:127.0.0.1:{port}"])
    gdb = ["gdb", "-q", "-batch", "-nx", "-ex", f"source {script}",
           "-ex", f"python trace({port}, '{out}', {warm}, {steps})", str(vmlinux)]
    if shell.dry_run:
        shell.show(qemu)
        shell.show(gdb)
        return []
    for tool in ("gdb", "qemu-system-x86_64", "nm"):
        if shutil.which(tool) is None:
            raise LabError(f"trace: {tool} not found (make deps installs it)")
    work.mkdir(parents=True, exist_ok=True)
    script.write_text(GDB_SCRIPT)
    vm = subprocess.Popen(qemu, start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    try:
        for _ in range(50):  # the stub listens once QEMU is up
            if vm.poll() is not None:
                err = vm.stderr.read().decode() if vm.stderr else ""
                raise LabError(f"trace: QEMU exited at start: {err.strip()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        try:
            res = subprocess.run(gdb, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise LabError(f"trace: gdb did not finish in {timeout_s:.0f} s "
                           f"(console: {work / 'console.log'})") from None
        (work / "gdb.log").write_text(res.stdout + res.stderr)
    finally:
        try:
            os.killpg(vm.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        vm.wait()
    if not out.exists():
        raise LabError(f"trace: no trace written; see {work / 'gdb.log'}")
    pcs = [int(line, 16) for line in out.read_text().split()]
    if len(pcs) < steps:
        raise LabError(f"trace: {len(pcs)} of {steps} steps; see {work / 'gdb.log'}")
    return pcs


def table(results: dict[str, Iteration]) -> str:
    """Functions down, kernels across, with the difference to the first."""
    labels = list(results)
    names: list[str] = []
    for it in results.values():
        names += [n for n in it.functions if n not in names]
    width = max([len(n) for n in names] + [8])
    col = max([10, *(len(lb) for lb in labels)])
    head = f"{'function':{width}s} " + " ".join(f"{lb:>{col}s}" for lb in labels)
    if len(labels) > 1:
        head += f" {'diff':>6s}"
    lines = [head]
    for n in names + ["total"]:
        vals = [it.total if n == "total" else it.functions.get(n, 0)
                for it in results.values()]
        row = f"{n:{width}s} " + " ".join(f"{v:{col}d}" for v in vals)
        if len(vals) > 1:
            row += f" {vals[-1] - vals[0]:+6d}"
        lines.append(row)
    return "\n".join(lines)


def save(path: Path, results: dict[str, Iteration]) -> None:
    path.write_text(json.dumps({k: {"total": v.total, "functions": v.functions,
                                    "lengths": v.lengths}
                                for k, v in results.items()}, indent=1))


# -- a page-fault loop, counted per translation block (TCG plugin) -------------

PLUGIN_SOURCE = paths.REPO / "lab" / "qemu-plugin" / "blockcount.c"
# kernel text starts here on x86_64; below it is the guest's user space
KERNEL_START = 0xFFFF800000000000
USER = "[user]"
FAULT_LOOP_MIB = 512
# iterations of the short and the long boot: their difference is measured
FAULT_LOOPS = (2, 12)


def fault_script(iterations: int) -> str:
    """Settle, then the churn loop on 4 KiB pages (guest/churn.c)."""
    return (f"sleep 10\nchurn --mib {FAULT_LOOP_MIB} --iterations {iterations} "
            "--sleep-ms 0 --tag churn\n")


def build_plugin(shell: Shell) -> Path:
    """libblockcount.so, built once per source against QEMU 10.0.2's plugin
    header (the QEMU the lab runs)."""
    src = PLUGIN_SOURCE.read_bytes()
    key = hashlib.sha256(src + qemu_mod.BASE_VERSION.encode()).hexdigest()[:16]
    out = paths.cache_dir() / "qemu-plugin" / key / "libblockcount.so"
    if out.exists():
        return out
    include = qemu_mod.base_tree(shell) / "include" / "qemu"
    glib = shell.run(["pkg-config", "--cflags", "glib-2.0"], capture=True,
                     what="pkg-config glib-2.0 (libglib2.0-dev)").split()
    if not shell.dry_run:
        out.parent.mkdir(parents=True, exist_ok=True)
    shell.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
               "-Werror", "-o", out, PLUGIN_SOURCE, "-I", include, *glib],
              what="build the QEMU plugin")
    return out


def parse_blocks(text: str) -> list[tuple[int, int, int]]:
    """(start address, instructions, runs) per line of the plugin's output."""
    blocks = []
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        try:
            pc, insns, runs = int(parts[0], 16), int(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            raise LabError(f"trace: block counts, line {n}: {line!r}") from None
        blocks.append((pc, insns, runs))
    return blocks


def per_function(blocks: list[tuple[int, int, int]], syms: Symbols) -> Counter[str]:
    """Executed instructions per kernel function; user space as USER."""
    out: Counter[str] = Counter()
    for pc, insns, runs in blocks:
        out[USER if pc < KERNEL_START else syms.name(pc)] += insns * runs
    return out


def per_fault(short: Counter[str], long: Counter[str], faults: int) -> dict[str, float]:
    """What the long boot executed beyond the short one, per page fault."""
    if faults <= 0:
        raise LabError(f"trace: the long loop took {faults} more faults than the short one")
    return {k: (long[k] - short[k]) / faults for k in set(short) | set(long)}


def churn_faults(console: str) -> int:
    """total_faults of the churn record a boot printed."""
    for line in console.splitlines():
        start = line.find('{"prog":"churn"')
        if start >= 0:
            return int(json.loads(line[start:])["total_faults"])
    raise LabError("trace: the guest printed no churn record")


def count_blocks(shell: Shell, build_dir: Path, initrd: Path, plugin: Path, work: Path,
                 timeout_s: float = 900) -> tuple[list[tuple[int, int, int]], str]:
    """Boot the kernel in `build_dir` with the plugin; its block counts and console."""
    image = build_dir / "arch" / "x86" / "boot" / "bzImage"
    counts = work / "blocks.txt"
    console = work / "console.log"
    # -icount: guest time is instructions, so timers land at the same
    # places in every boot, and the free lists the loop meets do not
    # depend on the host's speed
    qemu = tcg_argv(image, initrd, 2048, console, "fp.halt=reboot",
                    ["-icount", "shift=0", "-plugin", f"{plugin},out={counts}"])
    shell.show(qemu)
    if shell.dry_run:
        return [], ""
    work.mkdir(parents=True, exist_ok=True)
    vm = subprocess.Popen(qemu, start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    try:
        _, err = vm.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(vm.pid, signal.SIGKILL)
        vm.wait()
        raise LabError(f"trace: the guest did not finish in {timeout_s:.0f} s "
                       f"(console: {console})") from None
    text = console.read_text(errors="replace") if console.exists() else ""
    if vm.returncode != 0 or "FREEPAGE-EXIT 0" not in text:
        raise LabError(f"trace: the guest failed (QEMU exit {vm.returncode}, "
                       f"{err.decode(errors='replace').strip()[-300:]}; console: {console})")
    if not counts.exists():
        raise LabError(f"trace: the plugin wrote no counts ({counts})")
    return parse_blocks(counts.read_text()), text


def fault_table(results: dict[str, dict[str, float]], top: int = 25) -> str:
    """Instructions per fault: the functions that differ most, then the total."""
    labels = list(results)
    names = sorted({n for r in results.values() for n in r},
                   key=lambda n: -abs(results[labels[-1]].get(n, 0.0)
                                      - results[labels[0]].get(n, 0.0)))
    width = max([len(n) for n in names[:top]] + [8])
    col = max([10, *(len(lb) for lb in labels)])
    lines = [f"{'function':{width}s} " + " ".join(f"{lb:>{col}s}" for lb in labels)
             + (f" {'diff':>8s}" if len(labels) > 1 else "")]
    for n in [*names[:top], "total"]:
        vals = [sum(r.values()) if n == "total" else r.get(n, 0.0) for r in results.values()]
        row = f"{n:{width}s} " + " ".join(f"{v:{col}.1f}" for v in vals)
        if len(vals) > 1:
            row += f" {vals[-1] - vals[0]:+8.1f}"
        lines.append(row)
    return "\n".join(lines)

"""Where the allocator fast path spends its instructions, per function.

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
"""

from __future__ import annotations

import bisect
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
    qemu = ["qemu-system-x86_64", "-machine", "pc,accel=tcg", "-cpu", "max", "-smp", "1",
            "-m", "512M", "-kernel", str(image), "-initrd", str(initrd),
            "-append", "console=ttyS0 panic=-1 nokaslr quiet loglevel=4",
            "-display", "none", "-monitor", "none", "-nodefaults", "-no-reboot",
            "-serial", f"file:{work / 'console.log'}", "-S", "-gdb", f"tcp:127.0.0.1:{port}"]
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
    head = f"{'function':{width}s} " + " ".join(f"{lb:>10s}" for lb in labels)
    if len(labels) > 1:
        head += f" {'diff':>6s}"
    lines = [head]
    for n in names + ["total"]:
        vals = [it.total if n == "total" else it.functions.get(n, 0)
                for it in results.values()]
        row = f"{n:{width}s} " + " ".join(f"{v:10d}" for v in vals)
        if len(vals) > 1:
            row += f" {vals[-1] - vals[0]:+6d}"
        lines.append(row)
    return "\n".join(lines)


def save(path: Path, results: dict[str, Iteration]) -> None:
    path.write_text(json.dumps({k: {"total": v.total, "functions": v.functions,
                                    "lengths": v.lengths}
                                for k, v in results.items()}, indent=1))

"""vmcreate: VM creation on a host whose free memory was pre-zeroed.

The Debian guest (platform qemu-debian) stands for the host: Debian's
QEMU inside it starts a VM of `vm_mib` with its memory preallocated
(`memory-backend-ram,prealloc=on`: QEMU populates all of it with
MADV_POPULATE_WRITE before the VM runs), and `vmstart` (guest/) times
the start to the VM's first instruction. The VM's firmware is the lab's
own 64 KiB image (`firmware()`): at the reset vector it writes one byte
to the serial port (0x3f8, QEMU's stdout) and halts, so the byte's
arrival is the first instruction. At that moment vmstart reads the CPU
time QEMU's threads spent (schedstat), then kills it.

Variants (the prezero family), interleaved per repetition (ABBA order):
  vanilla  stock 6.12
  off      the series, pre-zeroing disabled
  on       the series, pre-zeroing enabled: the guest's free memory is
           cleared ahead of time, the VM's memory is taken known zero
  limit    the series + kernel/bench/unsafe-no-user-page-zeroing.patch
           (user pages never cleared: the fastest such a start can be)

Per boot, every variant does the same: one start of a small VM (not
measured), so that every measured start finds QEMU and its libraries in
the page cache; then it dirties the guest's free memory but
`free_margin_mib` (0xa5 in every byte: a host that has been running)
and frees it. Then per mode: wait until the pre-zeroing counters stand
still (on: the free memory is cleared meanwhile, at `warm_cpu_percent`
of the CPU; the others: just that idle time), then start the VM with
the pgzero_* counters read around it. What a mode's VM used is freed
when it is killed, not known zero: the next mode's wait clears it again.

Modes: 4k (transparent_hugepage=never), thp (madvise: QEMU madvises its
RAM MADV_HUGEPAGE), none (the same VM without prealloc, on 4 KiB pages:
QEMU's start alone, the part no zeroing can shorten).

Guest time under -icount shift=0,sleep=off (the default) is executed
instructions: the start's time and QEMU's CPU time are then counts of
guest instructions that the host's load does not move. The host's wall
time between two console lines (the start, and vmstart's mark at the
byte) is reported beside them; under TCG it moves with the host's load.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..guestshell import PREZERO_COUNTERS, prezero_helpers, require_prezero, thp
from ..initramfs import EVENT
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table
from .prezero import counts_instructions, delta, parse_events, warn_unless_bench

PROG = "vmstart"
VARIANTS = ("vanilla", "off", "on", "limit")
# the THP setting of each mode (QEMU madvises its RAM MADV_HUGEPAGE)
MODES = {"4k": "never", "thp": "madvise", "none": "never"}
# the VM's memory preallocated in these modes
PREALLOC_MODES = ("4k", "thp")

# The VM's firmware, as QEMU loads a -bios image: its end at the top of
# the 4 GiB space, the last 16 bytes holding the reset vector (real mode,
# CS:IP F000:FFF0). The code writes FIRST_BYTE to COM1 and halts.
FIRMWARE_BYTES = 64 * 1024  # QEMU takes whole multiples of 64 KiB
COM1 = 0x3F8
FIRST_BYTE = 0x21  # "!"
RESET_CODE = bytes([
    0xBA, COM1 & 0xFF, COM1 >> 8,  # mov dx, COM1
    0xB0, FIRST_BYTE,              # mov al, FIRST_BYTE
    0xEE,                          # out dx, al
    0xFA,                          # cli
    0xF4,                          # hlt
    0xEB, 0xFD,                    # jmp to the hlt
])
RESET_VECTOR = 16
# where the guest script writes it
FIRMWARE_PATH = "/tmp/vmcreate-firmware.bin"
QEMU = "qemu-system-x86_64"
# the unmeasured start that fills the page cache, MiB
WARMUP_VM_MIB = 64
# the VM's translation cache, MiB (QEMU's default reserves 1 GiB)
TB_MIB = 32


def firmware() -> bytes:
    """The VM's firmware image: zeroes, then the reset vector's code
    padded with hlt to 16 bytes."""
    return bytes(FIRMWARE_BYTES - RESET_VECTOR) + RESET_CODE.ljust(RESET_VECTOR, b"\xf4")


def firmware_shell(path: str = FIRMWARE_PATH) -> str:
    """A shell line that writes firmware() to `path` (printf's octal
    escapes for the reset vector; head and /dev/zero for the rest)."""
    image = firmware()
    code = image[-RESET_VECTOR:]
    escapes = "".join(f"\\{b:03o}" for b in code)
    return (f"{{ head -c {len(image) - RESET_VECTOR} /dev/zero; printf '{escapes}'; }} > {path}")


def qemu_argv(vm_mib: int, prealloc: bool, firmware_path: str = FIRMWARE_PATH) -> list[str]:
    """The VM the guest starts: TCG, one vCPU, `vm_mib` of RAM in a
    memory backend (prealloc=on: populated before the VM runs, by QEMU's
    main thread), the lab's firmware, COM1 on QEMU's stdout, nothing else."""
    if vm_mib < 1:
        raise LabError(f"vmcreate: the VM needs memory, not {vm_mib} MiB")
    backend = (f"memory-backend-ram,id=vm-ram,size={vm_mib}M,"
               f"prealloc={'on' if prealloc else 'off'},prealloc-threads=1")
    return [QEMU, "-machine", "pc,memory-backend=vm-ram", "-accel", f"tcg,tb-size={TB_MIB}",
            "-cpu", "qemu64", "-smp", "1", "-m", f"{vm_mib}M", "-object", backend,
            "-bios", firmware_path, "-display", "none", "-monitor", "none", "-nodefaults",
            "-serial", "stdio", "-no-reboot"]


def vmstart_line(tag: str, vm_mib: int, prealloc: bool, timeout_s: int) -> str:
    """Guest shell: time one start (vmstart), its mark line at the byte."""
    argv = qemu_argv(vm_mib, prealloc)
    return (f"vmstart --tag {tag} --timeout-s {timeout_s} --mark '{EVENT} vm-first-byte {tag}'"
            f" -- {' '.join(argv)}")


@dataclass
class VmcreateParams:
    # the guest: the host the VM is created on
    mem_mib: int = 1536
    # the VM it creates
    vm_mib: int = 1024
    modes: tuple[str, ...] = ("4k", "thp", "none")
    variants: tuple[str, ...] = ("vanilla", "off", "on")
    repeat: int = 5
    # the dirtying populate leaves this much of the free memory alone
    free_margin_mib: int = 256
    # the pool is cleared at this CPU share, then set back to the default
    warm_cpu_percent: int = 100
    stable_s: int = 3
    wait_timeout_s: int = 900
    start_timeout_s: int = 900
    icount: bool = True
    timeout_s: int = 3600


def check_params(p: VmcreateParams) -> None:
    unknown = [m for m in p.modes if m not in MODES]
    if unknown or not p.modes:
        raise LabError(f"vmcreate: unknown modes {unknown or list(p.modes)}; "
                       f"choose from {', '.join(MODES)}")
    if p.repeat < 1:
        raise LabError("vmcreate: repeat >= 1")
    if p.vm_mib < 1 or p.vm_mib + p.free_margin_mib >= p.mem_mib:
        raise LabError(f"vmcreate: a {p.vm_mib} MiB VM with {p.free_margin_mib} MiB to spare "
                       f"does not fit a {p.mem_mib} MiB guest (mem_mib, vm_mib, free_margin_mib)")


def mode_lines(p: VmcreateParams, mode: str) -> list[str]:
    return [thp(MODES[mode]),
            f"ev start {mode}",
            f"knob cpu_percent {p.warm_cpu_percent}",
            f"prezero_wait {p.wait_timeout_s} {mode}",
            "knob cpu_percent 10",
            f"ev warm {mode}",
            f"echo \"{EVENT} vm-start {mode}\"",
            vmstart_line(mode, p.vm_mib, mode in PREALLOC_MODES, p.start_timeout_s),
            f"ev measured {mode}"]


def guest_script(p: VmcreateParams, variant: str) -> str:
    lines = [prezero_helpers(p.stable_s), firmware_shell()]
    if variant == "on":
        lines += [require_prezero("vmcreate"), "knob enabled 1"]
    lines += [thp("never"),
              vmstart_line("warmup", WARMUP_VM_MIB, True, p.start_timeout_s),
              "free=$(awk '$1 == \"MemFree:\" {print int($2 / 1024)}' /proc/meminfo)",
              f"populate --mib $((free - {p.free_margin_mib})) --mode 4k --fill 0xa5 --tag dirty"]
    for mode in p.modes:
        lines += mode_lines(p, mode)
    lines.append("knob enabled 0")
    return "\n".join(lines) + "\n"


@dataclass
class Start:
    """One measured start of the VM."""

    mode: str
    first_byte_ms: float  # guest time: instructions (1e-6) under icount
    cpu_ms: float  # QEMU's threads, schedstat
    cpu_ticks: int
    host_s: float | None  # host wall time, console line to console line
    rss_mib: float
    anon_huge_mib: float
    counters: dict[str, int]  # pgzero_* over the start
    marked: int  # pages pre-zeroed while warming


def event_time(lines: Sequence[Any], name: str, mode: str) -> float | None:
    """Host time of the console line "<EVENT> name mode" (None if absent)."""
    want = f"{EVENT} {name} {mode}"
    for ln in lines:
        if ln.text.strip() == want:
            return float(ln.t)
    return None


def parse_starts(records: Sequence[dict[str, Any]], lines: Sequence[Any],
                 modes: Sequence[str], vm_mib: int) -> list[Start]:
    """The measured starts of one boot, in `modes` order, from vmstart's
    lines and the console (ConsoleLine: .t, .text); a start that did not
    reach its first byte, or a VM whose memory was not preallocated, fails."""
    texts = [ln.text for ln in lines]
    events = parse_events(texts)
    out = []
    for mode in modes:
        rec = next((r for r in records if r.get("tag") == mode), None)
        if rec is None:
            raise LabError(f"vmcreate: no {PROG} line for {mode}")
        if rec["outcome"] != "first_byte" or rec["byte"] != FIRST_BYTE:
            raise LabError(f"vmcreate: the {mode} VM did not reach its first instruction: "
                           f"{rec['outcome']}, byte {rec['byte']}, exit {rec['exit_status']}")
        if rec["cpu_ns"] < 0:
            raise LabError("vmcreate: no /proc/<pid>/task/<tid>/schedstat in the guest "
                           "(CONFIG_SCHED_INFO): QEMU's CPU time is not known")
        rss_mib = rec["rss_kib"] / 1024
        if mode in PREALLOC_MODES and rss_mib < vm_mib:
            raise LabError(f"vmcreate: the {mode} VM's QEMU holds {rss_mib:.0f} MiB at its "
                           f"first instruction, less than the {vm_mib} MiB preallocated")
        t0, t1 = event_time(lines, "vm-start", mode), event_time(lines, "vm-first-byte", mode)
        warm = delta(events, mode, "start", "warm")
        out.append(Start(mode, rec["first_byte_ns"] / 1e6, rec["cpu_ns"] / 1e6,
                         rec["cpu_ticks"], None if t0 is None or t1 is None else t1 - t0,
                         rss_mib, rec["anon_huge_kib"] / 1024,
                         delta(events, mode, "warm", "measured"),
                         warm.get("pgzero_marked_prezero", 0)))
    return out


class Vmcreate(Scenario):
    name = "vmcreate"
    Params = VmcreateParams
    platforms = ("qemu-debian",)
    needs = "a Debian root with Debian's QEMU, which starts the VM inside the guest"

    def run(self, ctx: RunContext, params: VmcreateParams) -> Outcome:
        check_params(params)
        # Debian's QEMU comes with the tools root
        ctx = ctx.on(ctx.platform, root_tools=True)
        icount = counts_instructions(ctx, params.icount)
        if icount:
            harness.check_icount(ctx, self.name)
        variants = harness.pick(self.name, "prezero", params.variants)
        warn_unless_bench(ctx, self.name)
        runs: dict[str, list[Start]] = {v: [] for v in params.variants}

        def plan(variant: harness.Variant) -> harness.Plan:
            return self.plan(params, guest_script(params, variant.name),
                             f"vmcreate-{variant.name}", icount=icount)

        for booted in harness.rounds(ctx, variants, params.repeat, "vmcreate", plan):
            try:
                runs[booted.variant.name] += parse_starts(
                    booted.records(PROG), booted.guest.lines, params.modes, params.vm_mib)
            except LabError as exc:
                raise booted.error(str(exc)) from None
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data = summarise_run(params, runs)
        data.update(platform=ctx.platform,
                    time_unit="instructions (1e-6)" if icount else "ms")
        ctx.save(f"vmcreate-{ctx.platform}", data)
        return Outcome(self.name, data, render(data))


# ratios as median(b) / median(a) of (key, a, b): stock time / on time is the speed-up
RATIOS = (("vanilla_over_on", "on", "vanilla"), ("off_over_on", "on", "off"),
          ("off_over_vanilla", "vanilla", "off"), ("on_over_limit", "limit", "on"))


def summarise_run(p: VmcreateParams, runs: dict[str, list[Start]]) -> dict[str, Any]:
    data: dict[str, Any] = {"params": asdict(p), "modes": {}}
    for mode in p.modes:
        entry: dict[str, Any] = {}
        for v in p.variants:
            mine = [s for s in runs[v] if s.mode == mode]
            if not mine:
                continue
            tot = {k: sum(s.counters.get(k, 0) for s in mine) for k in PREZERO_COUNTERS}
            host = [s.host_s for s in mine if s.host_s is not None]
            entry[v] = {"first_byte_ms": summarise([s.first_byte_ms for s in mine]).as_dict(),
                        "cpu_ms": summarise([s.cpu_ms for s in mine]).as_dict(),
                        "host_s": summarise(host).as_dict() if host else None,
                        "raw": [asdict(s) for s in mine],
                        "anon_huge_mib_median": statistics.median(s.anon_huge_mib for s in mine),
                        "marked_while_warming": sum(s.marked for s in mine),
                        "during_start": tot}
        for key, a, b in RATIOS:
            if a in entry and b in entry:
                entry[key] = {what: median_ratio(
                    [s[what] for s in entry[a]["raw"]],
                    [s[what] for s in entry[b]["raw"]]).as_dict()
                    for what in ("first_byte_ms", "cpu_ms")}
        data["modes"][mode] = entry
    return data


def render(data: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for mode, entry in data["modes"].items():
        for v in VARIANTS:
            if v not in entry:
                continue
            e = entry[v]

            def med(s: dict[str, float] | None, fmt: str = "{:.0f}") -> str:
                if not s:
                    return "n/a"
                return (f"{fmt.format(s['median'])} [{fmt.format(s['p25'])}-"
                        f"{fmt.format(s['p75'])}]")

            c = e["during_start"]
            rows.append([mode, v, med(e["first_byte_ms"]), med(e["cpu_ms"]),
                         med(e["host_s"], "{:.1f}"), f"{e['anon_huge_mib_median']:.0f}",
                         e["marked_while_warming"], c["pgzero_skipped"], c["pgzero_missed"],
                         e["first_byte_ms"]["n"]])
        for key, label in (("vanilla_over_on", "stock/on"), ("off_over_on", "off/on"),
                           ("off_over_vanilla", "off/stock"), ("on_over_limit", "on/limit")):
            if key in entry:
                r = entry[key]
                rows.append([mode, label, fmt_ratio(r["first_byte_ms"]), fmt_ratio(r["cpu_ms"]),
                             "", "", "", "", "", ""])
    p = data["params"]
    unit = data.get("time_unit", "ms")
    return (f"vmcreate ({data.get('platform')}: a {p['mem_mib']} MiB guest starts a "
            f"{p['vm_mib']} MiB VM; start = QEMU's start to the VM's first instruction, "
            f"CPU = QEMU's threads, both in {unit}; host = the host's wall seconds; "
            "median [p25-p75]; THP = AnonHugePages at the first instruction, MiB; counters "
            "summed over the boots: marked = pages pre-zeroed while warming, skipped/missed "
            "during the start; ratios: median with bootstrap 95% interval)\n"
            + table(["mode", "variant", "start", "CPU", "host s", "THP", "marked", "skipped",
                     "missed", "n"], rows))

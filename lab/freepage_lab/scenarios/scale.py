"""scale: what free page reporting and pre-zeroing cost per GiB, and how that grows with the guest.

QEMU x86_64, the series' kernel, one guest per size in `sizes_gib`
(1, 8, 32 by default; 128 where the host has room for the guest's memmap,
about 1.6% of its RAM, which the guest writes at boot). A guest larger
than the host's RAM plus swap gets RAM with reserve=off
(runners.reserves_ram()): the host backs only what the guest touches.
Every repetition boots each size with each variant, sizes and variants
in ABBA order.

Variants (harness.FAMILIES["scale"]):
  reporting  the balloon with free page reporting, on the run's QEMU. The
             guest reports all its free memory (a flush whose budget is
             its RAM: what boot leaves free), then fills `pool_mib` with
             data, frees it and reports that (a second flush). Per phase,
             from the series' counters: reported pages, passes, and
             time_us, the passes' wall time with the device's discard.
  prezero    no balloon, so every free block is pre-zeroing's. kprezerod
             at cpu_percent=100 and a target_percent that makes it clear
             about `prezero_mib` (target_percent() of the free memory),
             enabled until its counters settle: the CPU time the scheduler
             charged to it (schedstat), the pages it cleared
             (pgzero_marked_prezero) and its scans of the zones.
Cost = time per GiB reported or cleared. Also per boot: the host's seconds from
the guest's start to its script (the boot, which grows with the memmap)
and the VMM's peak RSS.

Timings are TCG's (-icount with icount=true: guest time counts
instructions, one per virtual ns, and the device's discard then counts
as the time the guest waited for it in virtual time): compare sizes of
one run, not with hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import harness
from ..context import RunContext
from ..guest import ConsoleLine
from ..guestshell import (
    BALLOON_BOUND,
    PREZERO_DIR,
    flush_cmd,
    kcpu_function,
    kcpu_snapshot,
    prezero_helpers,
    reporting_snapshot,
    require_prezero,
    zeroed_counter,
)
from ..initramfs import EVENT
from ..procfs import host_available_mib
from ..runners import check_host_room
from ..shell import LabError
from ..stats import summarise
from . import Outcome, Scenario, table

VARIANTS = tuple(harness.family("scale"))
PAGES_PER_GIB = 1 << 18
# the rows of the cost table: (variant, phase, what the cost is per GiB of)
PHASES = (("reporting", "boot", "reported"), ("reporting", "pool", "reported"),
          ("prezero", "clear", "cleared"))


@dataclass
class ScaleParams:
    sizes_gib: tuple[int, ...] = (1, 8, 32)
    variants: tuple[str, ...] = VARIANTS
    repeat: int = 3
    pool_mib: int = 512
    prezero_mib: int = 512
    # turn pre-zeroing off once it cleared prezero_mib (prezero_stop_at()),
    # whatever target_percent does: off only to test that target
    prezero_stop: bool = True
    # seconds pre-zeroing may take to settle (prezero_wait)
    prezero_wait_s: int = 600
    icount: bool = False
    # a boot and each wait get timeout_s plus timeout_s_per_gib a GiB of RAM
    timeout_s: int = 600
    timeout_s_per_gib: int = 10


def check_params(p: ScaleParams, available_mib: int | None) -> None:
    """Refuses bad parameters, and sizes whose guests would not fit the
    host's `available_mib` (their memmap, the memory they write, the rest;
    None: not checked, as in a dry run); sizes given as text (--param
    sizes_gib=1,8) become ints."""
    try:
        p.sizes_gib = tuple(int(s) for s in p.sizes_gib)
    except ValueError:
        raise LabError(f"scale: sizes_gib must be whole GiB, not {p.sizes_gib}") from None
    if not p.sizes_gib or any(s < 1 for s in p.sizes_gib):
        raise LabError(f"scale: sizes_gib must be at least 1, not {p.sizes_gib}")
    if p.repeat < 1:
        raise LabError(f"scale: repeat must be at least 1, not {p.repeat}")
    for name in ("pool_mib", "prezero_mib"):
        if not 0 < getattr(p, name) <= min(p.sizes_gib) * 1024 // 2:
            raise LabError(f"scale: {name} must be above 0 and at most half the smallest "
                           f"guest ({min(p.sizes_gib) * 512} MiB), not {getattr(p, name)}")
    if available_mib is not None:
        for size in p.sizes_gib:
            check_host_room("scale", [(size * 1024, written_mib(p, size))], available_mib)


def written_mib(p: ScaleParams, size_gib: int) -> int:
    """The most a guest of `size_gib` writes: the pool, or what pre-zeroing
    clears, which may be up to a percent of its RAM more than asked
    (target_percent())."""
    return max(p.pool_mib, p.prezero_mib + size_gib * 1024 // 100)


def target_percent(prezero_mib: int, mem_mib: int) -> int:
    """The target_percent at which pre-zeroing stops after clearing about
    `prezero_mib` of a guest of `mem_mib` (it clears that share of the free
    memory it may take), rounded up, 1..100."""
    return max(1, min(100, -(-prezero_mib * 100 // mem_mib)))


def timeout(p: ScaleParams, size_gib: int) -> int:
    return p.timeout_s + p.timeout_s_per_gib * size_gib


def start_line() -> str:
    """The guest's uptime when its script starts: how long it booted."""
    return f"echo \"{EVENT} script uptime_ms $(awk '{{printf \"%d\", $1 * 1000}}' /proc/uptime)\""


def reporting_script(p: ScaleParams, mem_mib: int) -> str:
    return "\n".join([
        start_line(), BALLOON_BOUND, reporting_snapshot(),
        # everything free at boot (the series reports it on its own, the
        # flush finishes what is left and waits for it)
        flush_cmd(mem_mib * 256),
        "reporting boot",
        f"populate --mib {p.pool_mib} --mode 4k --fill 0xa5 --tag pool",
        flush_cmd(p.pool_mib * 256 * 2),
        "reporting pool",
    ]) + "\n"


def prezero_stop_at(mib: int) -> str:
    """Guest shell, in the background while pre-zeroing runs: turn it off
    once it marked `mib` more MiB zero (checked every second, so it may
    clear up to a second's worth more), and say so. target_percent is a
    whole percent of the free memory, which at large sizes is far from
    `mib`, and the thread stops at about 1 GiB per zone whatever the
    target (what its count of known zero blocks looks at)."""
    count = zeroed_counter("pgzero_marked_prezero")
    on = f"{PREZERO_DIR}/enabled"
    return (f"( base=$({count}); while [ \"$(cat {on})\" = 1 ]; do sleep 1; "
            f"if [ $(( $({count}) - base )) -ge {mib * 256} ]; then "
            f"echo 0 > {on}; echo \"{EVENT} prezero stopped at {mib} MiB\"; fi; done ) &")


def prezero_script(p: ScaleParams, mem_mib: int) -> str:
    snap = kcpu_snapshot(f"{EVENT} prezero {{}}") + " $(vm)\""
    return "\n".join([
        start_line(), prezero_helpers(), kcpu_function(), require_prezero("scale"),
        "knob cpu_percent 100",
        f"knob target_percent {target_percent(p.prezero_mib, mem_mib)}",
        snap.format("start"),
        "knob enabled 1",
        *([prezero_stop_at(p.prezero_mib)] if p.prezero_stop else []),
        f"prezero_wait {p.prezero_wait_s}",
        snap.format("end"),
        "knob enabled 0",
    ]) + "\n"


SCRIPTS = {"reporting": reporting_script, "prezero": prezero_script}


@dataclass
class Cost:
    """One phase of one boot: what it did and what that took."""

    size_gib: int
    variant: str
    phase: str
    gib: float  # reported or cleared
    ms: float  # time_us, or kprezerod's CPU time
    count: int  # reporting passes, or pre-zeroing's scans
    boot_s: float
    peak_rss_mib: float
    exact: bool = True  # kprezerod's CPU from the scheduler, not ticks

    @property
    def ms_per_gib(self) -> float:
        return self.ms / self.gib if self.gib else 0.0


def boot_seconds(lines: list[ConsoleLine], started: float) -> float:
    """Host seconds from the guest's start to its script's first line: the
    whole boot, with the memmap's initialisation, which comes before the
    guest's own clock starts (its uptime leaves it out)."""
    for line in lines:
        w = line.text.split()
        if len(w) == 4 and w[0] == EVENT and w[1] == "script":
            return line.t - started
    raise LabError("scale: the guest never said when its script started")


def reporting_costs(records: list[dict], size_gib: int, boot_s: float,
                    peak_rss_mib: float) -> list[Cost]:
    """The reporting phases of one boot from its `reporting` JSON lines:
    "boot" from the kernel's start, "pool" the difference to it."""
    by_tag = {r["tag"]: r for r in records if r.get("prog") == "reporting"}
    if "boot" not in by_tag or "pool" not in by_tag:
        raise LabError(f"scale: reporting counters missing ({sorted(by_tag)} of boot, pool); "
                       "is this the series' kernel?")
    zero = {"reported_pages": 0, "time_us": 0, "passes": 0}
    out = []
    for phase, before, after in (("boot", zero, by_tag["boot"]),
                                 ("pool", by_tag["boot"], by_tag["pool"])):
        out.append(Cost(size_gib, "reporting", phase,
                        (after["reported_pages"] - before["reported_pages"]) / PAGES_PER_GIB,
                        (after["time_us"] - before["time_us"]) / 1000,
                        after["passes"] - before["passes"], boot_s, peak_rss_mib))
    return out


def prezero_cost(lines: list[str], size_gib: int, boot_s: float,
                 peak_rss_mib: float) -> Cost:
    """The pre-zeroing phase of one boot from its start and end lines
    ("<EVENT> prezero start cpu_ns N exact 0|1 <counter> <value>...")."""
    snaps: dict[str, dict[str, int]] = {}
    for line in lines:
        w = line.split()
        if len(w) >= 3 and w[0] == EVENT and w[1] == "prezero" and w[2] in ("start", "end"):
            snaps[w[2]] = {k: int(v) for k, v in zip(w[3::2], w[4::2])}
    if "start" not in snaps or "end" not in snaps:
        raise LabError("scale: pre-zeroing's start or end line is missing")
    a, b = snaps["start"], snaps["end"]
    for name in ("pgzero_marked_prezero", "pgzero_prezero_scans"):
        if name not in a or name not in b:
            raise LabError(f"scale: no {name} counter; is this the series' kernel?")
    return Cost(size_gib, "prezero", "clear",
                (b["pgzero_marked_prezero"] - a["pgzero_marked_prezero"]) / PAGES_PER_GIB,
                (b["cpu_ns"] - a["cpu_ns"]) / 1e6,
                b["pgzero_prezero_scans"] - a["pgzero_prezero_scans"], boot_s, peak_rss_mib,
                bool(a["exact"] and b["exact"]))


def summarise_run(p: ScaleParams, costs: list[Cost]) -> dict[str, Any]:
    """Per size and phase: median [p25-p75, min-max] of the cost per GiB, the
    GiB done, the counts, the boot and the peak RSS; and the growth of the
    cost per GiB from the smallest size (ratio of medians)."""
    data: dict[str, Any] = {"params": asdict(p), "sizes": {},
                            "raw": [{**asdict(c), "ms_per_gib": c.ms_per_gib} for c in costs]}
    for size in p.sizes_gib:
        entry: dict[str, Any] = {}
        for variant, phase, _ in PHASES:
            mine = [c for c in costs if c.size_gib == size and c.variant == variant
                    and c.phase == phase and c.gib > 0]
            if not mine:
                continue
            entry[f"{variant}/{phase}"] = {
                "ms_per_gib": summarise([c.ms_per_gib for c in mine]).as_dict(),
                "gib": summarise([c.gib for c in mine]).as_dict(),
                "count": summarise([float(c.count) for c in mine]).as_dict(),
                "boot_s": summarise([c.boot_s for c in mine]).as_dict(),
                "peak_rss_mib": summarise([c.peak_rss_mib for c in mine]).as_dict(),
                "exact": all(c.exact for c in mine)}
        data["sizes"][str(size)] = entry
    smallest = str(min(p.sizes_gib))
    for entry in data["sizes"].values():
        for key, e in entry.items():
            base = data["sizes"][smallest].get(key)
            if base and base["ms_per_gib"]["median"]:
                e["growth"] = e["ms_per_gib"]["median"] / base["ms_per_gib"]["median"]
    return data


def render(data: dict[str, Any]) -> str:
    rows = []
    for size, entry in data["sizes"].items():
        for variant, phase, of in PHASES:
            e = entry.get(f"{variant}/{phase}")
            if not e:
                continue
            c, g = e["ms_per_gib"], e["gib"]
            rows.append([size, variant, phase,
                         f"{c['median']:.1f} [{c['p25']:.1f}-{c['p75']:.1f}]"
                         + ("" if e["exact"] else " *"),
                         f"{e['growth']:.2f}x" if "growth" in e else "",
                         f"{g['median']:.2f} {of}", f"{e['count']['median']:.0f}",
                         f"{e['boot_s']['median']:.1f}", f"{e['peak_rss_mib']['median']:.0f}",
                         c["n"]])
    p = data["params"]
    return (f"scale (QEMU, the series; reporting: time_us, the passes' wall time with the "
            f"device's discard; pool {p['pool_mib']} MiB freed after boot; prezero: kprezerod's "
            f"CPU time, cpu_percent=100, about {p['prezero_mib']} MiB cleared; ms per GiB "
            "median [p25-p75], growth = over the smallest guest's median; "
            f"{'icount: guest time counts instructions' if p['icount'] else 'TCG wall time'}; "
            "* = from ticks, not the scheduler)\n"
            + table(["GiB", "variant", "phase", "ms/GiB", "growth", "done (GiB)",
                     "passes/scans", "boot s", "peak RSS MiB", "n"], rows))


def plot(data: dict[str, Any], path: Path) -> None:
    from ..plot import scaling_plot

    series: dict[str, tuple[list[float], list[float], list[float], list[float]]] = {}
    labels = {"reporting/boot": "reporting: free memory at boot",
              "reporting/pool": "reporting: a freed pool",
              "prezero/clear": "pre-zeroing: clearing"}
    for key, label in labels.items():
        pts = [(int(size), e[key]["ms_per_gib"]) for size, e in data["sizes"].items() if key in e]
        if pts:
            series[label] = ([float(s) for s, _ in pts], [c["median"] for _, c in pts],
                             [c["p25"] for _, c in pts], [c["p75"] for _, c in pts])
    scaling_plot(path, series, "guest RAM (GiB)", "ms per GiB (median, p25-p75)",
                 "free page reporting and pre-zeroing: cost per GiB by guest size")


def plan(p: ScaleParams, variant: str, size_gib: int) -> harness.Plan:
    return harness.Plan(SCRIPTS[variant](p, size_gib * 1024), initrd=f"scale-{variant}-{size_gib}g",
                        mem_mib=size_gib * 1024, icount=p.icount,
                        timeout_s=timeout(p, size_gib), footprint_s=1.0)


def boot_costs(booted: harness.Booted, size_gib: int) -> list[Cost]:
    """The phases of one boot, with its boot time and the VMM's peak RSS."""
    boot_s = boot_seconds(booted.guest.lines, booted.guest.started)
    peak = max((s.bytes for s in booted.footprint), default=0) / (1 << 20)
    if booted.variant.name == "reporting":
        return reporting_costs(booted.records(), size_gib, boot_s, peak)
    return [prezero_cost(booted.lines, size_gib, boot_s, peak)]


class Scale(Scenario):
    name = "scale"
    Params = ScaleParams
    platforms = ("qemu",)
    needs = "x86_64 QEMU: guests of many GiB, the balloon's reporting"

    def run(self, ctx: RunContext, params: ScaleParams) -> Outcome:
        check_params(params, None if ctx.shell.dry_run else host_available_mib())
        variants = harness.pick(self.name, "scale", params.variants)
        costs: list[Cost] = []
        # sizes and variants alternate (ABBA) in every repetition, so that
        # the host's load drifts over all of them alike
        for rep in range(params.repeat):
            for size in harness.order(params.sizes_gib, rep):
                for variant in harness.order(variants, rep):
                    booted = harness.boot(ctx, variant, f"scale-{size}g-{variant.name}-{rep}",
                                          plan(params, variant.name, size))
                    if booted is None:
                        continue
                    for c in boot_costs(booted, size):
                        costs.append(c)
                        # each phase as it ends: a run cut short still says what it got
                        print(f"scale {size} GiB {c.variant}/{c.phase} round {rep}: "
                              f"{c.gib:.2f} GiB in {c.ms:.0f} ms ({c.ms_per_gib:.0f} ms/GiB), "
                              f"{c.count} passes/scans, boot {c.boot_s:.0f} s, "
                              f"peak RSS {c.peak_rss_mib:.0f} MiB", flush=True)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data = summarise_run(params, costs)
        ctx.save("scale", data)
        png = ctx.run_dir / "scale.png"
        plot(data, png)
        return Outcome(self.name, data, render(data), plots=[str(png)])

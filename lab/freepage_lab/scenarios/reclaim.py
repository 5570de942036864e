"""reclaim: the guest populates X MiB, frees it; how fast does the host get it back?

Variants (harness.FAMILIES["reclaim"]), each a guest kernel on the same
host side (Debian's QEMU for qemu, vhost-user-balloon with its defaults
for uml, as the published figures were measured), booted in turn,
`repeat` times each, the order rotated per repeat so that drift hits
every variant alike:

  off       stock 6.12, the device does not offer free page reporting
  stock     stock 6.12 (2 s delay, 1/16 of each free list per pass)
  stock250  stock 6.12 + kernel/bench/stock-delay-250ms.patch
  freepage  the kernel series (kernel/*/patches) with their default knobs
  context   whatever the run context stands for (--vanilla,
            --patched-qemu): the single-kernel behaviour of old
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import harness
from ..context import RunContext
from ..footprint import Sample, analyse_reclaim, value_at
from ..guestshell import (
    BALLOON_BOUND,
    COUNTER_TAG,
    FLUSH,
    MEMSTATE_PROG,
    REPORTING_DIR,
    REPORTING_ORDER,
    memstate_function,
    pcp_high_fraction,
    reporting_counters,
    reporting_snapshot,
    reporting_tracer,
    thp,
)
from ..initramfs import EVENT
from ..plot import timeline_plot
from ..shell import LabError
from . import Outcome, Scenario, fmt_s, table
from .churn import reporting_trace

MIB = 1 << 20
# reclaim goals: (fraction of the freed memory, within seconds of the free)
GOALS = ((0.90, 1.0), (0.99, 2.0))


CONTEXT = harness.CONTEXT.name


@dataclass
class ReclaimParams:
    mem_mib: int = 2048
    populate_mib: int = 512
    modes: tuple[str, ...] = ("4k", "thp")
    variants: tuple[str, ...] = ("off", "stock", "stock250", "freepage")
    # boots per variant
    repeat: int = 5
    # populate/free rounds per mode in one boot
    rounds: int = 1
    settle_s: int = 15
    fill: int = 0xA5
    # footprint sampling period (50 Hz)
    interval_s: float = 0.02
    # vm.percpu_pagelist_high_fraction in the guest; 0 keeps the kernel's
    # default (per-cpu lists may hold 1/8 of a zone; stock 6.12 never
    # reports what they hold, the series drains them after a bulk free)
    pcp_high_fraction: int = 0
    # after each settle, on a kernel with the series' knobs: report every
    # free block of this order or above once (then restore the order), to
    # measure what the host still backs in smaller free blocks; -1: no probe
    probe_order: int = -1
    # the smallest order reported (page_reporting_order), set before the
    # first round, stock and series alike; -1: the driver's (pageblock order)
    reporting_order: int = -1
    # vm.compaction_proactiveness for the whole boot (0-100: the higher, the
    # less fragmentation of free memory kcompactd lets stand before it
    # compacts in the background); -1: the kernel's default (20)
    compaction_proactiveness: int = -1
    # 1: compact every zone (vm.compact_memory) right after each free, so
    # that reporting finds the pageblocks the free left mostly empty whole
    # (what a compaction aimed at them would get at best); 0: no
    compact_after_free: int = 0
    # series only: print the reporting counters every N ms through the
    # boot (a diagnostic: the sampler costs the guest some CPU); 0: off
    trace_ms: int = 0
    timeout_s: int = 300


def rounds_of(p: ReclaimParams) -> list[str]:
    """The mode of each populate/free round of one boot, in order."""
    return [m for m in p.modes for _ in range(p.rounds)]


def guest_script(p: ReclaimParams) -> str:
    lines = [BALLOON_BOUND, memstate_function(), "echo 3 > /proc/sys/vm/drop_caches",
             thp("madvise")]
    if p.pcp_high_fraction:
        lines.append(pcp_high_fraction(p.pcp_high_fraction))
    if p.reporting_order >= 0:
        lines.append(f"echo {p.reporting_order} > {REPORTING_ORDER}")
    if not -1 <= p.compaction_proactiveness <= 100:
        raise LabError(f"compaction_proactiveness={p.compaction_proactiveness}: the kernel "
                       "takes 0 to 100 (-1: leave its default)")
    if p.compaction_proactiveness >= 0:
        lines.append(f"echo {p.compaction_proactiveness} > /proc/sys/vm/compaction_proactiveness")
    if p.compact_after_free not in (0, 1):
        raise LabError(f"compact_after_free={p.compact_after_free}: 0 or 1")
    if p.trace_ms:
        lines += [reporting_snapshot(), reporting_tracer(p.trace_ms)]
    for i, mode in enumerate(rounds_of(p)):
        lines += [
            f"memstate 'before {i}'",
            f"echo {EVENT} populate {i}",
            f"populate --mib {p.populate_mib} --mode {mode} --fill {p.fill} --tag reclaim",
            f"echo {EVENT} freed {i}",
            *(["echo 1 > /proc/sys/vm/compact_memory"] if p.compact_after_free else []),
            f"sleep {p.settle_s}",
            f"memstate 'settled {i}'",
        ]
        if p.probe_order >= 0:
            lines += [f"echo {EVENT} probe {i}", probe_below_order(p.probe_order),
                      f"memstate 'probed {i}'", f"echo {EVENT} probed {i}"]
    if p.trace_ms:
        lines.append("kill $tracer || true")
    lines.append(reporting_counters())
    return "\n".join(lines) + "\n"


def probe_below_order(order: int) -> str:
    """Guest shell: lower the reporting order to `order`, report everything
    free once, wait for the host, put the order back (nothing on stock)."""
    knob = REPORTING_ORDER
    return (f"if [ -w {FLUSH} ]; then o=$(cat {knob}); echo {order} > {knob}; "
            f"echo 1000000 > {FLUSH} 2>/dev/null || true; sleep 2; echo $o > {knob}; "
            "else sleep 2; fi")


def parse_counters(lines: list[str]) -> dict[str, int | list[int]]:
    """The series' reporting counters the guest script printed (none: stock kernel)."""
    out: dict[str, int | list[int]] = {}
    for text in lines:
        m = re.match(rf"^{COUNTER_TAG} (\w+) ([\d ]+)$", text.strip())
        if not m:
            continue
        nums = [int(x) for x in m.group(2).split()]
        out[m.group(1)] = nums if len(nums) > 1 else nums[0]
    return out


@dataclass
class Boot:
    """One guest's life: its rounds, timelines (seconds since its start) and counters."""

    variant: str
    repeat: int
    rounds: list[dict[str, Any]]
    sample_rate_hz: float
    timeline: dict[str, list[float]]
    huge_timeline: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, int | list[int]] = field(default_factory=dict)
    # the series' counters every trace_ms (seconds since the guest's boot)
    trace: list[dict[str, Any]] = field(default_factory=list)
    # what a background workload said of itself (reclaim-io: its rates)
    workload: list[dict[str, Any]] = field(default_factory=list)


class ReclaimScenario(Scenario):
    name = "reclaim"
    Params = ReclaimParams

    def run(self, ctx: RunContext, params: ReclaimParams) -> Outcome:
        known = harness.family("reclaim")
        for name in params.variants:
            if name != CONTEXT and name not in known:
                raise LabError(f"reclaim: unknown variant {name!r}; choose from "
                               f"{', '.join([*known, CONTEXT])}")
        if not params.variants or params.repeat < 1 or params.rounds < 1:
            raise LabError("reclaim: needs at least one variant, repeat >= 1 and rounds >= 1")
        variants = [harness.CONTEXT if n == CONTEXT else known[n] for n in params.variants]
        n = len(rounds_of(params))
        steps = ("populate", "freed") + (("probe", "probed") if params.probe_order >= 0 else ())
        plan = self.plan(params, self.script(params), self.name,
                         marks=tuple(f"{what} {i}" for i in range(n) for what in steps),
                         footprint_s=params.interval_s, huge_s=0.1)
        ctx.initrd(plan.initrd, plan.script)
        if ctx.shell.dry_run:  # each variant's command line once
            for v in variants:
                harness.boot(ctx, v, f"{self.name}-{v.name}-0", plan)
            return Outcome(self.name, {}, "(dry run)")
        boots = []
        for rep in range(params.repeat):
            for v in harness.order(variants, rep, rotate=True):
                print(f"{self.name}: {v.name}, repeat {rep + 1}/{params.repeat}", flush=True)
                booted = harness.boot(ctx, v, f"{self.name}-{v.name}-{rep}", plan)
                assert booted is not None
                boots.append(self._boot(params, booted, rep))
        return self._report(ctx, params, boots)

    def script(self, params: Any) -> str:
        return guest_script(params)

    def _boot(self, params: ReclaimParams, booted: harness.Booted, rep: int) -> Boot:
        n = len(rounds_of(params))
        populate = [booted.marks[f"populate {i}"].line.t for i in range(n)]
        freed = [booted.marks[f"freed {i}"].line.t for i in range(n)]
        samples = booted.footprint
        freed_bytes = params.populate_mib * MIB
        t0 = booted.guest.started
        ends = [*populate[1:], samples[-1].t if samples else float("inf")]
        probed: list[dict[str, Any]] = [{} for _ in range(n)]
        if params.probe_order >= 0:
            # a round ends where its probe starts; the probe's own effect apart
            for i in range(n):
                tq, tqd = booted.marks[f"probe {i}"].line.t, booted.marks[f"probed {i}"].line.t
                ends[i] = tq
                if samples:
                    probed[i] = {"probe_order": params.probe_order, "probe_released_mib":
                                 (value_at(samples, tq) - value_at(samples, tqd)) / MIB}
        rounds = []
        states = {r["tag"]: r for r in booted.records(MEMSTATE_PROG)}
        for i, (mode, tp, tf, te) in enumerate(zip(rounds_of(params), populate, freed, ends)):
            part = [s for s in samples if tp <= s.t < te]
            rounds.append(analyse_round(part, value_at(samples, tp) if samples else 0, tf,
                                        freed_bytes)
                          | {"t_freed_s": tf - t0, "mode": mode, "round": i}
                          | _backing(samples, booted.huge, tp, tf, te)
                          | memstate_change(states.get(f"before {i}"),
                                            states.get(f"settled {i}"))
                          | probed[i])
        return Boot(booted.variant.name, rep, rounds, booted.footprint_hz,
                    {"t_s": [s.t - t0 for s in samples],
                     "footprint_mib": [s.bytes / MIB for s in samples]},
                    {"t_s": [s.t - t0 for s in booted.huge],
                     "anon_huge_mib": [s.bytes / MIB for s in booted.huge]},
                    parse_counters(booted.lines), reporting_trace(booted.records()))

    def _report(self, ctx: RunContext, params: ReclaimParams, boots: list[Boot]) -> Outcome:
        rates = [b.sample_rate_hz for b in boots]
        summary = {v: {m: summarise([r for b in boots if b.variant == v for r in b.rounds
                                     if r["mode"] == m]) for m in params.modes}
                   for v in params.variants}
        first = {v: next(b for b in boots if b.variant == v) for v in params.variants}
        # the last variant is the one under test: its first boot at the top
        # level, as a single-kernel run has always had it
        head = first[params.variants[-1]]
        data: dict[str, Any] = {
            "platform": ctx.platform,
            "params": asdict(params),
            "sample_rate_hz": min(rates),
            "sample_rate_hz_range": [min(rates), max(rates)],
            "boot_order": [b.variant for b in boots],
            "rounds": head.rounds,
            "timeline": head.timeline,
            "variants": {v: {"summary": summary[v],
                             "boots": [asdict(b) for b in boots if b.variant == v]}
                         for v in params.variants},
            "median": {m: {k: s["median"] for k, s in summary[head.variant][m].items()
                           if isinstance(s, dict) and "median" in s}
                       for m in params.modes},
            "reporting_counters": {v: [b.counters for b in boots if b.variant == v]
                                   for v in params.variants
                                   if any(b.counters for b in boots if b.variant == v)},
        }
        label = f"{self.name}-{ctx.platform}" + (f"-pcp{params.pcp_high_fraction}"
                                             if params.pcp_high_fraction else "")
        plot = ctx.run_dir / f"{label}.png"
        marks = [r["t_freed_s"] for r in head.rounds]
        timeline_plot(plot, [], [], marks,
                      f"{self.name} on {ctx.platform}: {params.populate_mib} MiB freed per round "
                      f"({', '.join(rounds_of(params))}), first boot of each variant",
                      {v: (b.timeline["t_s"], b.timeline["footprint_mib"])
                       for v, b in first.items()})
        pcp = (f", percpu_pagelist_high_fraction={params.pcp_high_fraction}"
               if params.pcp_high_fraction else ", default per-cpu lists")
        text = (f"{self.name} ({ctx.platform}, guest {params.mem_mib} MiB, {params.populate_mib} MiB "
                f"freed per round{pcp}, {params.repeat} boots per variant, footprint sampled at "
                f"{min(rates):.0f}-{max(rates):.0f} Hz; median [min-max] of "
                f"{params.repeat * params.rounds} rounds)\n"
                + release_table(summary, params.modes))
        guest = guest_table(summary, params.modes)
        if guest:
            text += ("\n\nchange from before the populate to the end of the settle, MiB, "
                     "median [min-max]\n" + guest)
        if any(s.get("anon_huge_mib") for v in summary.values() for s in v.values()):
            text += "\n\nhost THP backing (AnonHugePages of the VMM, MiB, median)\n" + \
                backing_table(summary, params.modes)
        for v, counters in data["reporting_counters"].items():
            text += f"\n\n{v}: {REPORTING_DIR} at the end of each boot\n" + "\n".join(
                "  " + ", ".join(f"{k}={_fmt_counter(c)}" for k, c in cs.items())
                for cs in counters)
        ctx.save(label, data)
        return Outcome(self.name, data, text, [str(plot)])


PAGE = 4096


def analyse_round(samples: list[Sample], base: int, t_freed: float,
                  freed_bytes: int) -> dict[str, Any]:
    """One round against what the populate added to the host footprint.

    The populate's pages are not all new to the host: some were backed
    already (the guest had used them since boot), so the footprint grows
    by less than the populate's size. What the free can give back is
    that growth (`base` is the footprint before the populate): t50/t90/
    t99 and `fraction` are of it; `fraction_of_freed` and `t99_of_freed_s`
    keep the populate's size as the yardstick, `left_behind_mib` is the
    lowest footprint after the free less the one before the populate.
    """
    of_freed = analyse_reclaim(samples, t_freed, freed_bytes)
    added = of_freed.before_bytes - base
    r = analyse_reclaim(samples, t_freed, added) if added > 0 else of_freed
    return asdict(r) | {"added_bytes": added, "fraction_of_freed": of_freed.fraction,
                        "t99_of_freed_s": of_freed.t99_s,
                        "left_behind_mib": (r.after_bytes - base) / MIB}


def memstate_change(before: dict[str, Any] | None,
                    settled: dict[str, Any] | None) -> dict[str, Any]:
    """Where the guest's free memory went between before the populate and
    the end of the settle (MiB): free blocks below the reporting order
    (reporting never sees them), at or above it, on the per-cpu lists.
    Without a reporting device the order is -1: the largest order stands in."""
    if not before or not settled:
        return {}
    order = int(settled["reporting_order"])
    if order < 0:
        order = len(settled["free_blocks"]) - 1

    def mib(state: dict[str, Any], low: bool) -> float:
        return sum(n << o for o, n in enumerate(state["free_blocks"])
                   if (o < order) == low) * PAGE / MIB

    return {"reporting_order": order,
            "guest_free_below_order_mib": mib(settled, True) - mib(before, True),
            "guest_free_at_order_mib": mib(settled, False) - mib(before, False),
            "guest_pcp_mib": (settled["pcp_pages"] - before["pcp_pages"]) * PAGE / MIB,
            "guest_memfree_mib": (settled["memfree_kib"] - before["memfree_kib"]) / 1024,
            "guest_free_below_order_settled_mib": mib(settled, True),
            "guest_pcp_settled_mib": settled["pcp_pages"] * PAGE / MIB}


def _fmt_counter(c: int | list[int]) -> str:
    return "[" + " ".join(map(str, c)) + "]" if isinstance(c, list) else str(c)


def _backing(samples: list[Sample], huge: list[Sample], tp: float, tf: float,
             te: float) -> dict[str, float | None]:
    """Footprint and THP backing (MiB) before populate, populated, and released."""
    out: dict[str, float | None] = {}
    for key, ss in (("footprint", samples), ("anon_huge", huge)):
        inside = [s for s in ss if tp <= s.t <= tf]
        out[f"{key}_before_populate_mib"] = value_at(ss, tp) / MIB if ss else None
        out[f"{key}_populated_mib"] = max(s.bytes for s in inside) / MIB if inside else None
        out[f"{key}_released_mib"] = value_at(ss, te) / MIB if ss else None
    return out


def spread(xs: list[float | None]) -> dict[str, Any]:
    """Median and range; None (never reached) ranks above every number."""
    inf = float("inf")
    vals = sorted(inf if x is None else x for x in xs)
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "reached": 0}
    med = statistics.median(vals)

    def num(x: float) -> float | None:
        return None if x == inf or x != x else x

    return {"median": num(med), "min": num(vals[0]), "max": num(vals[-1]), "n": len(vals),
            "reached": sum(1 for x in xs if x is not None)}


GUEST_CHANGES = ("guest_free_below_order_mib", "guest_free_at_order_mib", "guest_pcp_mib",
                 "guest_memfree_mib", "guest_free_below_order_settled_mib",
                 "guest_pcp_settled_mib", "probe_released_mib")


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: spread([r.get(k) for r in rounds])
                           for k in ("t50_s", "t90_s", "t99_s", "fraction", "fraction_of_freed",
                                     "t99_of_freed_s", "left_behind_mib")}
    for k in GUEST_CHANGES:
        if rounds and all(k in r for r in rounds):
            out[k] = spread([r[k] for r in rounds])
    out["released_mib"] = spread([(r["before_bytes"] - r["after_bytes"]) / MIB for r in rounds])
    for frac, within in GOALS:
        key = f"t{round(frac * 100)}_s"
        hits = sum(1 for r in rounds if r[key] is not None and r[key] <= within)
        med = out[key]["median"]
        out[f"{key.removesuffix('_s')}_within_{within:g}s"] = {
            "met": med is not None and med <= within, "rounds": hits, "of": len(rounds)}
    for key in ("footprint", "anon_huge"):
        for when in ("before_populate", "populated", "released"):
            vals = [r.get(f"{key}_{when}_mib") for r in rounds]
            if all(v is not None for v in vals) and vals:
                out.setdefault(f"{key}_mib", {})[when] = statistics.median(
                    v for v in vals if v is not None)
    return out


def _cell(s: dict[str, Any], pct: bool = False) -> str:
    if pct:
        return (f"{s['median'] * 100:.0f}% [{s['min'] * 100:.0f}-{s['max'] * 100:.0f}]"
                if s["median"] is not None else "n/a")
    if s["n"] == 0:
        return "n/a"
    med = fmt_s(s["median"]) if s["median"] is not None else "never"
    lo = fmt_s(s["min"]) if s["min"] is not None else "never"
    hi = fmt_s(s["max"]) if s["max"] is not None else "never"
    return f"{med} [{lo}-{hi}]"


def release_table(summary: dict[str, dict[str, dict[str, Any]]], modes: tuple[str, ...]) -> str:
    rows = []
    for mode in modes:
        for v, per_mode in summary.items():
            s = per_mode[mode]
            goals = []
            for frac, within in GOALS:
                g = s[f"t{round(frac * 100)}_within_{within:g}s"]
                goals.append(f"{'yes' if g['met'] else 'no'} ({g['rounds']}/{g['of']})")
            rows.append([mode, v, _cell(s["t50_s"]), _cell(s["t90_s"]), _cell(s["t99_s"]),
                         _cell(s["fraction"], pct=True), _cell(s["fraction_of_freed"], pct=True),
                         _mib(s["left_behind_mib"]), *goals])
    return table(["mode", "variant", "t50 s", "t90 s", "t99 s", "released",
                  "of populate size", "left behind MiB", ">=90% in 1 s", ">=99% in 2 s"],
                 rows) + ("\n(times and released: of what the populate added to the host "
                          "footprint; left behind: lowest footprint after the free less the "
                          "one before the populate)")


def _mib(s: dict[str, Any]) -> str:
    if s["n"] == 0 or s["median"] is None or s["min"] is None or s["max"] is None:
        return "n/a"
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def guest_table(summary: dict[str, dict[str, dict[str, Any]]], modes: tuple[str, ...]) -> str:
    """Where the guest's free memory grew from before the populate to the
    end of the settle, beside what the host kept (and what a report of
    every smaller block then released)."""
    rows = []
    for mode in modes:
        for v, per_mode in summary.items():
            s = per_mode[mode]
            if "guest_memfree_mib" not in s:
                continue
            rows.append([mode, v, _mib(s["left_behind_mib"]),
                         *(_mib(s[k]) if k in s else "-" for k in GUEST_CHANGES)])
    return table(["mode", "variant", "host: left behind", "guest: free below order",
                  "free at/above order", "per-cpu lists", "MemFree",
                  "settled: free below order", "settled: per-cpu lists",
                  "host: released by the probe"], rows) if rows else ""


def backing_table(summary: dict[str, dict[str, dict[str, Any]]], modes: tuple[str, ...]) -> str:
    rows = []
    for mode in modes:
        for v, per_mode in summary.items():
            fp = per_mode[mode].get("footprint_mib", {})
            ah = per_mode[mode].get("anon_huge_mib", {})
            rows.append([mode, v] + [f"{ah.get(w, 0):.0f} / {fp.get(w, 0):.0f}"
                                     for w in ("before_populate", "populated", "released")])
    return table(["mode", "variant", "before populate", "after populate", "after release"],
                 [[*r[:2], *r[2:]] for r in rows]) + "\n(AnonHugePages / RSS)"


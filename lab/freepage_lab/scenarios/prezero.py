"""prezero: populate from a warm pool of pre-zeroed pages.

Variants, interleaved per repetition (ABBA order) in one run:
  vanilla  stock 6.12
  off      the series, pre-zeroing disabled (/sys/kernel/mm/prezero/enabled=0)
  on       the series, pre-zeroing enabled; the pool is warm: the guest
           waits until kprezerod has stopped marking pages before it
           populates
  limit    the series + kernel/bench/unsafe-no-user-page-zeroing.patch:
           user pages faulted in by `populate` are never cleared, the
           fastest a populate can be (UNSAFE, test-only)

Per mode, every variant does the same: dirty `populate_mib` (fill 0xa5)
and free it, wait until the pgzero_marked_prezero and
pgzero_prezero_hugetlb counters have not moved for `stable_s` seconds
(stock/off/limit: just that idle time; on: the pool is cleared meanwhile,
at `warm_cpu_percent` of a CPU), then time the measured run with the
pgzero_* vmstat counters read around it.

Modes: 4k, thp, hugetlb (populate --mode; hugetlb from a static pool of
`populate_mib` set up before the dirtying run, which kprezerod clears with
its hugetlb knob on) and kzero<order> (the kernels of a run with such a
mode carry kernel/bench/page-zeroed-bench.patch: `zero <order> <mib>`
allocates __GFP_ZERO blocks inside the kernel, no page faults; the limit
kernel clears those like off, so limit is skipped there).

The guests have no balloon: no free page reporting device, so pre-zeroing
may take every order from min_order (default pageblock_order) up.
Kernels: --fragment bench.config (no debug verification, -O2), as the
numbers are wanted; QEMU runs TCG with -icount shift=0,sleep=off unless
icount=false, so guest ns are executed instructions there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .. import harness, platforms
from ..context import RunContext
from ..guestshell import (
    BENCH_PROG,
    PREZERO_COUNTERS,
    bench_function,
    pcp_high_fraction,
    prezero_helpers,
    require_prezero,
    thp,
)
from ..initramfs import EVENT
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table
from .zerobench import BENCH_PATCH

COUNTERS = PREZERO_COUNTERS
VARIANTS = ("vanilla", "off", "on", "limit")
PLATFORM_MODES = {"uml": ("4k", "kzero9", "kzero0"), "qemu": ("thp", "4k", "hugetlb")}
POPULATE_MODES = ("4k", "thp", "hugetlb")
HUGE_PAGE_MIB = 2
EVENT_RE = re.compile(rf"^{EVENT} (\S+) (\S+)((?: \S+ -?\d+)*)\s*$")


def parse_events(lines: Sequence[str]) -> list[tuple[str, str, dict[str, int]]]:
    """(name, mode, counters) of every event line, in order."""
    out = []
    for line in lines:
        m = EVENT_RE.match(line.strip())
        if not m:
            continue
        words = m.group(3).split()
        out.append((m.group(1), m.group(2),
                    {k: int(v) for k, v in zip(words[::2], words[1::2])}))
    return out


def delta(events: Sequence[tuple[str, str, dict[str, int]]], mode: str, a: str,
          b: str) -> dict[str, int]:
    """Counter deltas between events a and b of one mode (empty if either is missing)."""
    got = {name: c for name, m, c in events if m == mode}
    if a not in got or b not in got:
        return {}
    return {k: got[b][k] - got[a].get(k, 0) for k in got[b]}


@dataclass
class PrezeroParams:
    mem_mib: int = 2048
    populate_mib: int = 1024
    # empty: the platform's default (PLATFORM_MODES)
    modes: tuple[str, ...] = ()
    variants: tuple[str, ...] = VARIANTS
    repeat: int = 5
    # -1: the kernel's default (pageblock_order)
    min_order: int = -1
    # the pool is warmed at this CPU share, then set back to the default
    warm_cpu_percent: int = 100
    # > 0: /proc/sys/vm/percpu_pagelist_high_fraction in every variant, so
    # that no variant's populate starts from a per-cpu list full of dirty
    # pages (0: the kernel's default, which keeps up to an eighth of the
    # zone there after a bulk free; the series drains it when pre-zeroing)
    pcp_high_fraction: int = 0
    stable_s: int = 3
    wait_timeout_s: int = 600
    icount: bool = True
    timeout_s: int = 3600


def kzero_order(mode: str) -> int | None:
    m = re.fullmatch(r"kzero(\d+)", mode)
    return int(m.group(1)) if m else None


def check_params(p: PrezeroParams, platform: str) -> tuple[str, ...]:
    modes = p.modes or PLATFORM_MODES.get(platform, ())
    unknown = [v for v in p.variants if v not in VARIANTS]
    if unknown or not p.variants:
        raise LabError(f"prezero: unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    for mode in modes:
        order = kzero_order(mode)
        if mode not in POPULATE_MODES and (order is None or order > 10):
            raise LabError(f"prezero: unknown mode {mode!r}: 4k, thp, hugetlb, kzero<0..10>")
        if mode in POPULATE_MODES and mode not in platforms.platform(platform).populate_modes:
            raise LabError(f"prezero: {platform} has no {mode}")
    if not modes:
        raise LabError("prezero: no modes")
    if p.populate_mib >= p.mem_mib or p.populate_mib % HUGE_PAGE_MIB or p.repeat < 1:
        raise LabError("prezero: populate_mib must be even and below mem_mib; repeat >= 1")
    return modes


def mode_lines(p: PrezeroParams, mode: str, variant: str) -> list[str]:
    order = kzero_order(mode)
    if order is not None and variant == "limit":
        return []  # the limit patch only spares user pages
    mib = p.populate_mib
    lines = [f"ev start {mode}"]
    if mode == "hugetlb":
        pages = mib // HUGE_PAGE_MIB
        lines += [f"echo {pages} > /proc/sys/vm/nr_hugepages",
                  f"[ \"$(cat /proc/sys/vm/nr_hugepages)\" = {pages} ] || "
                  f"{{ echo \"prezero: only $(cat /proc/sys/vm/nr_hugepages) of {pages} huge "
                  "pages\" >&2; exit 5; }"]
    dirty_mode = "4k" if order is not None else mode
    lines += [f"populate --mib {mib} --mode {dirty_mode} --fill 0xa5 --tag dirty",
              f"knob cpu_percent {p.warm_cpu_percent}",
              f"prezero_wait {p.wait_timeout_s} {mode}",
              "knob cpu_percent 10",
              f"ev warm {mode}"]
    if order is None:
        # exit 1 = non-zero bytes: the limit kernel's by design, judged on the host
        lines.append(f"populate --mib {mib} --mode {mode} --verify --tag measure || [ $? -eq 1 ]")
    else:
        lines.append(f"bench zero {order} {mib}")
    lines.append(f"ev measured {mode}")
    if mode == "hugetlb":
        lines.append("echo 0 > /proc/sys/vm/nr_hugepages")
    return lines


def guest_script(p: PrezeroParams, modes: Sequence[str], variant: str) -> str:
    lines = [
        prezero_helpers(p.stable_s),
        bench_function("prezero"),
        thp("madvise"),
    ]
    if p.pcp_high_fraction > 0:
        lines.append(pcp_high_fraction(p.pcp_high_fraction))
    if variant == "on":
        lines += [require_prezero("prezero"),
                  f"[ {p.min_order} -lt 0 ] || knob min_order {p.min_order}",
                  "knob enabled 1"]
    for mode in modes:
        lines += mode_lines(p, mode, variant)
    lines.append("knob enabled 0")
    return "\n".join(lines) + "\n"


def variant_for(variant: harness.Variant, modes: Sequence[str]) -> harness.Variant:
    """The variant's kernel carries the in-kernel benchmark if a kzero mode needs it."""
    if any(kzero_order(m) is not None for m in modes):
        return replace(variant, extra_patches=(BENCH_PATCH, *variant.extra_patches))
    return variant


def counts_instructions(ctx: RunContext, icount: bool) -> bool:
    """Guest time counts instructions (QEMU TCG -icount) in this run."""
    return icount and bool(ctx.machine.icount)


def warn_unless_bench(ctx: RunContext, who: str) -> None:
    """Say so where the run's kernels are the series' test kernels."""
    if "bench.config" not in ctx.extra_fragments:
        print(f"{who}: no --fragment bench.config: the series' debug check reads every "
              "page it skips clearing; numbers are not representative", flush=True)


@dataclass
class Measure:
    mode: str
    ms: float
    counters: dict[str, int]
    marked: int
    nonzero_bytes: int


class Prezero(Scenario):
    name = "prezero"
    Params = PrezeroParams
    platforms = tuple(PLATFORM_MODES)

    @staticmethod
    def _guest(modes: Sequence[str], guest: harness.Booted) -> list[Measure]:
        variant_name = guest.variant.name
        events = parse_events(guest.lines)
        pops = [r for r in guest.records("populate") if r["tag"] == "measure"]
        bad = [r for r in pops if r["nonzero_bytes"] and variant_name != "limit"]
        if bad:
            raise guest.error(f"prezero: {bad[0]['nonzero_bytes']} non-zero bytes in a "
                              f"{bad[0]['mode']} populate: a page called zero was not")
        zeros = [r for r in guest.records(BENCH_PROG) if r.get("test") == "zero"]
        out = []
        for mode in modes:
            order = kzero_order(mode)
            if order is None:
                rec = next(r for r in pops if r["mode"] == mode)
                ms, nonzero = rec["populate_ns"] / 1e6, rec["nonzero_bytes"]
            elif variant_name == "limit":
                continue
            else:
                krec = next(r for r in zeros if int(r["order"]) == order)
                ms, nonzero = krec["alloc_total_ns"] / 1e6, 0
            warm = delta(events, mode, "start", "warm")
            out.append(Measure(mode, ms, delta(events, mode, "warm", "measured"),
                               warm.get("pgzero_marked_prezero", 0)
                               + warm.get("pgzero_prezero_hugetlb", 0), nonzero))
        return out

    def run(self, ctx: RunContext, params: PrezeroParams) -> Outcome:
        modes = check_params(params, ctx.platform)
        if counts_instructions(ctx, params.icount):
            harness.check_icount(ctx, self.name)
        variants = harness.pick(self.name, "prezero", params.variants)
        warn_unless_bench(ctx, self.name)
        runs: dict[str, list[Measure]] = {v: [] for v in params.variants}

        def plan(variant: harness.Variant) -> harness.Plan:
            return self.plan(params, guest_script(params, modes, variant.name),
                             f"prezero-{ctx.platform}-{variant.name}",
                             icount=counts_instructions(ctx, params.icount))

        for booted in harness.rounds(ctx, [variant_for(v, modes) for v in variants],
                                     params.repeat, f"prezero-{ctx.platform}", plan):
            runs[booted.variant.name] += self._guest(modes, booted)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        unit = "instructions (1e-6)" if counts_instructions(ctx, params.icount) else "ms"
        data = summarise_run(params, modes, runs)
        data.update(platform=ctx.platform, time_unit=unit)
        ctx.save(f"prezero-{ctx.platform}", data)
        plots = [str(plot(data, ctx.run_dir / f"prezero-{ctx.platform}.png"))]
        return Outcome(self.name, data, render(data, modes, params.variants), plots)


def summarise_run(p: PrezeroParams, modes: Sequence[str],
                  runs: dict[str, list[Measure]]) -> dict[str, Any]:
    data: dict[str, Any] = {"params": asdict(p), "modes": {}}
    for mode in modes:
        entry: dict[str, Any] = {}
        samples = {v: [m.ms for m in runs[v] if m.mode == mode] for v in p.variants}
        for v in p.variants:
            ms = [m for m in runs[v] if m.mode == mode]
            if not ms:
                continue
            tot = {k: sum(m.counters.get(k, 0) for m in ms) for k in COUNTERS}
            marked = sum(m.marked for m in ms)
            skipped = tot["pgzero_skipped"]
            entry[v] = {"ms": summarise(samples[v]).as_dict(), "raw_ms": samples[v],
                        "marked_while_warming": marked, "during_measure": tot,
                        "nonzero_bytes": sum(m.nonzero_bytes for m in ms),
                        # upper bound: with target_percent=100 the pool is all free
                        # memory, more than one run consumes (docs/results/prezero.md)
                        "unconsumed_share": (marked - skipped) / marked if marked else None}
        for key, a, b in (("speedup_on_over_vanilla", "on", "vanilla"),
                          ("speedup_off_over_vanilla", "off", "vanilla"),
                          ("on_over_limit", "limit", "on")):
            if samples.get(a) and samples.get(b):
                # median(b) / median(a): stock time / on time is the speed-up
                entry[key] = median_ratio(samples[a], samples[b]).as_dict()
        data["modes"][mode] = entry
    return data


def render(data: dict[str, Any], modes: Sequence[str], variants: Sequence[str]) -> str:
    rows: list[list[object]] = []
    for mode in modes:
        entry = data["modes"][mode]
        for v in variants:
            if v not in entry:
                continue
            e, s = entry[v], entry[v]["ms"]
            c = e["during_measure"]
            un = e["unconsumed_share"]
            rows.append([mode, v, f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]",
                         e["marked_while_warming"], c["pgzero_skipped"], c["pgzero_missed"],
                         c["pgzero_merge_lost"], c["pgzero_prezero_aborted"],
                         "" if un is None else f"{un * 100:.0f}%", s["n"]])
        for key, label in (("speedup_on_over_vanilla", "stock/on"),
                           ("speedup_off_over_vanilla", "stock/off"),
                           ("on_over_limit", "on/limit")):
            if key in entry:
                rows.append([mode, label, fmt_ratio(entry[key]), "", "", "", "", "", "", ""])
    unit = data.get("time_unit", "ms")
    return (f"prezero ({data.get('platform')}, {data['params']['populate_mib']} MiB; time in "
            f"{unit}, median [min-max]; counters summed over the runs: marked = pages "
            "pre-zeroed while warming, skipped/missed/merge_lost/aborted during the measured "
            "run; unconsumed = (marked - skipped) / marked, an upper bound of waste)\n"
            + table(["mode", "variant", "time", "marked", "skipped", "missed", "merge_lost",
                     "aborted", "unconsumed", "n"], rows))


def plot(data: dict[str, Any], dest: Path) -> Path:
    """Median time per mode and variant with min-max bars, normalised to stock."""
    from ..plot import _pyplot

    plt = _pyplot()
    modes = list(data["modes"])
    variants = [v for v in VARIANTS if any(v in data["modes"][m] for m in modes)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        xs, ys, lo, hi = [], [], [], []
        for j, m in enumerate(modes):
            e = data["modes"][m]
            if v not in e or "vanilla" not in e:
                continue
            base = e["vanilla"]["ms"]["median"]
            s = e[v]["ms"]
            xs.append(j + i * width)
            ys.append(s["median"] / base)
            lo.append((s["median"] - s["min"]) / base)
            hi.append((s["max"] - s["median"]) / base)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=v, capsize=2)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(modes))], modes)
    ax.set_ylabel("time / stock (median, min-max)")
    ax.set_title(f"pre-zeroing: {data['params']['populate_mib']} MiB on {data.get('platform')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest

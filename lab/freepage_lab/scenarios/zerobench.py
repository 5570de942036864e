"""zerobench: the allocator's own cost, measured inside the kernel (UML, QEMU).

A test-only kernel patch (kernel/bench/page-zeroed-bench.patch, applied to
every kernel of this scenario) adds /sys/module/page_zeroed_bench/parameters/run:

  zero <order> <mib>  time allocating <mib> MiB of __GFP_ZERO blocks of
                      <order> (clearing included), no page faults or user
                      space in the way
  fastpath <n>        alloc + free without __GFP_ZERO: order-0 pairs
                      (per-cpu list hits), batches of 512 order-0 pages
                      (refill and drain through the buddy lists), order-3
                      pairs: the overhead when nothing is known zero

Variants, alternating ABBA across boots in one run:
  vanilla  stock kernel + the bench patch (the overhead reference)
  off      patched kernel + bench patch, reported pages are not known zero
           (UML: vhost-user-balloon without --x-device-init-reported; QEMU:
           no override)
  on       patched kernel + bench patch, reported pages are known zero and
           __GFP_ZERO skips clearing them (bit 6 negotiated: UML through
           vhost-user-balloon, QEMU through the patched QEMU of qemu/)

Platforms: UML runs at native speed, but has no jump labels (every static
key test is a load and a branch) and its timings move with the host. QEMU
TCG runs a real x86_64 kernel (with jump labels when built with
--fragment bench.config, as it should be); by default it runs with
-icount shift=0,sleep=off, where guest time advances exactly 1 ns per
executed instruction: ns per operation are then guest instructions per
operation, deterministic up to interrupts (valgrind-like counts of the
real kernel; caches and branch prediction do not show).

Per boot: small per-cpu lists (percpu_pagelist_high_fraction=1000), then
per order and repetition: dirty `bench_mib` with populate, free it, report
now (page_reporting.flush; the stock kernel has its 2 s timer only), wait
`settle_s`, then `zero <order> <bench_mib>` with the pgzero_* vmstat deltas
read around it; finally `fastpath <fastpath_n>`, `fastpath_repeat` times.
fastpath gives the mean over each run and its fastest chunk (1024 pairs or
512 pages): a guest on a shared host is preempted now and then, and the
fastest chunk is what the allocator costs when it is not. `zero` compares
on with off only: the stock kernel cannot flush, so whether the host has
discarded its pages yet depends on its reporting timer.

Run it with the benchmark fragment, or the patched kernels verify every
page they hand out as known zero (costing what the feature saves):

  freepage run zerobench --platform uml --fragment bench.config

The guest copies the kernel's JSON lines out of the ring buffer (dmesg -c)
to stdout, where they start a console line (printk's copy carries a
timestamp).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..guestshell import (
    BENCH_PROG,
    BENCH_RUN,
    bench_function,
    flush_if_present,
    pcp_high_fraction,
    vmstat_delta,
    vmstat_save,
)
from ..shell import LabError
from ..stats import median_ratio, summarise
from . import Outcome, Scenario, table

# test-only: the in-kernel benchmark, applied to every kernel here
BENCH_PATCH = "page-zeroed-bench.patch"
RUN = BENCH_RUN
COUNTERS = ("pgzero_skipped", "pgzero_missed", "pgzero_marked_reported", "pgzero_merge_lost")
VARIANTS = ("vanilla", "off", "on")
MAX_PAGE_ORDER = 10
MAX_BENCH_MIB = 4096
MAX_FASTPATH_N = 10**8
# fastpath tests; a record has <test>_total_ns over (key) operations, and the
# fastest chunk, <test>_best_chunk_ns over <test>_chunk_ops operations
FASTPATH_TESTS = {"order0": "n", "batch512": "batch512_pages", "order3": "n"}
FASTPATH_PAIRS = (("ratio_off_over_vanilla", "vanilla", "off"),
                  ("ratio_on_over_vanilla", "vanilla", "on"))
RATIO_LABELS = {"ratio_on_over_off": "on/off", "ratio_off_over_vanilla": "off/vanilla",
                "ratio_on_over_vanilla": "on/vanilla"}


@dataclass
class ZerobenchParams:
    mem_mib: int = 1024
    bench_mib: int = 256
    orders: tuple[int, ...] = (0, 9)
    variants: tuple[str, ...] = VARIANTS
    repeat: int = 3
    rounds: int = 2
    fastpath_n: int = 200000
    fastpath_repeat: int = 5
    settle_s: int = 1
    pcp_high_fraction: int = 1000
    # QEMU TCG: count instructions (-icount shift=0,sleep=off)
    icount: bool = True
    timeout_s: int = 900


def check_params(p: ZerobenchParams) -> tuple[int, ...]:
    """Validate what the kernel side would refuse; return the orders as ints."""
    try:
        orders = tuple(int(o) for o in p.orders)
    except ValueError:
        raise LabError(f"zerobench: orders must be integers, got {p.orders}") from None
    unknown = [v for v in p.variants if v not in VARIANTS]
    if unknown or not p.variants:
        raise LabError(f"zerobench: unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if not orders:
        raise LabError("zerobench: no orders")
    if not 0 < p.bench_mib <= MAX_BENCH_MIB or p.bench_mib >= p.mem_mib:
        raise LabError(f"zerobench: bench_mib must be 1..{MAX_BENCH_MIB} and below mem_mib")
    for order in orders:
        # the guest's pages are 4 KiB: at least one block of that order
        if not 0 <= order <= MAX_PAGE_ORDER or (p.bench_mib << 20) < (4096 << order):
            raise LabError(f"zerobench: order {order} needs 0..{MAX_PAGE_ORDER} and a block "
                           f"no larger than bench_mib")
    if not 0 < p.fastpath_n <= MAX_FASTPATH_N:
        raise LabError(f"zerobench: fastpath_n must be 1..{MAX_FASTPATH_N}")
    if p.repeat < 1 or p.rounds < 1 or p.fastpath_repeat < 1:
        raise LabError("zerobench: repeat, rounds and fastpath_repeat must be >= 1")
    return orders


def guest_script(p: ZerobenchParams, orders: tuple[int, ...]) -> str:
    lines = [
        f"[ -w {RUN} ] || {{ echo 'zerobench: {RUN} missing: kernel without {BENCH_PATCH}'; "
        "exit 3; }",
        # one benchmark command; its JSON line copied from the ring buffer
        bench_function("zerobench"),
    ]
    if p.pcp_high_fraction:
        lines.append(pcp_high_fraction(p.pcp_high_fraction))
    for _ in range(p.repeat):
        for order in orders:
            lines += [
                # dirty the memory first: the pages the benchmark gets are not zero
                f"populate --mib {p.bench_mib} --mode 4k --fill 0x5a --tag warm",
                flush_if_present(),
                f"sleep {p.settle_s}",
                vmstat_save(COUNTERS, "/tmp/v0"),
                f"bench zero {order} {p.bench_mib}",
                vmstat_save(COUNTERS, "/tmp/v1"),
                # one JSON line with the counter deltas of that run
                vmstat_delta(f',"order":{order}'),
            ]
    lines += [f"bench fastpath {p.fastpath_n}"] * p.fastpath_repeat
    return "\n".join(lines) + "\n"


def zero_samples(records: list[dict]) -> dict[int, list[float]]:
    """ns per MiB of each `zero` record, by order."""
    out: dict[int, list[float]] = {}
    for r in records:
        if r.get("test") == "zero":
            out.setdefault(int(r["order"]), []).append(r["alloc_total_ns"] / r["mib"])
    return out


def fastpath_samples(records: list[dict], best: bool = False) -> dict[str, list[float]]:
    """ns per alloc + free of each `fastpath` record, by test (exact: total / count).

    best: of the fastest chunk instead of the whole run (none when n < a chunk).
    """
    out: dict[str, list[float]] = {t: [] for t in FASTPATH_TESTS}
    for r in records:
        if r.get("test") != "fastpath":
            continue
        for test, count in FASTPATH_TESTS.items():
            if not best:
                out[test].append(r[f"{test}_total_ns"] / r[count])
            elif r.get(f"{test}_best_chunk_ns"):
                out[test].append(r[f"{test}_best_chunk_ns"] / r[f"{test}_chunk_ops"])
    return out


def hit_counts(vmstat: list[dict], order: int) -> tuple[int, int]:
    """(skipped, missed) zeroing over the vmstat records of one order."""
    rows = [r for r in vmstat if r.get("order") == order]
    return (sum(r.get("pgzero_skipped", 0) for r in rows),
            sum(r.get("pgzero_missed", 0) for r in rows))


def ratios(samples: dict[str, list[float]], pairs: tuple[tuple[str, str, str], ...]) -> dict:
    """key -> median(b) / median(a) with its bootstrap interval, for the pairs present."""
    return {key: median_ratio(samples[a], samples[b]).as_dict()
            for key, a, b in pairs if samples.get(a) and samples.get(b)}


def counts_instructions(ctx: RunContext, params: ZerobenchParams) -> bool:
    """Guest time counts instructions (QEMU TCG -icount) in this run."""
    return params.icount and bool(ctx.machine.icount)


def time_unit(ctx: RunContext, params: ZerobenchParams) -> str:
    """What a guest "ns" is on this platform."""
    return "instructions" if counts_instructions(ctx, params) else "ns"


def spread(s: dict) -> str:
    return f"{s['median']:.0f} [{s['p25']:.0f}-{s['p75']:.0f}]"


def ratio_cell(r: dict) -> str:
    return f"{r['ratio']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}]"


class Zerobench(Scenario):
    name = "zerobench"
    Params = ZerobenchParams
    platforms = ("uml", "qemu")

    @staticmethod
    def _guest(params: ZerobenchParams, guest: harness.Booted,
               orders: tuple[int, ...]) -> tuple[list[dict], list[dict]]:
        # the device zeroes (bit 6: reported pages read as zero) for "on" only
        records = guest.records(BENCH_PROG)
        zeros = [r for r in records if r.get("test") == "zero"]
        fast = [r for r in records if r.get("test") == "fastpath"]
        if len(zeros) != params.repeat * len(orders) or len(fast) != params.fastpath_repeat:
            raise guest.error(f"zerobench: expected {params.repeat * len(orders)} zero and "
                              f"{params.fastpath_repeat} fastpath records, got {len(zeros)} "
                              f"and {len(fast)}")
        return records, guest.records("vmstat")

    def run(self, ctx: RunContext, params: ZerobenchParams) -> Outcome:
        orders = check_params(params)
        unit = time_unit(ctx, params)
        # before any kernel is built: -icount without TCG is an error
        if counts_instructions(ctx, params):
            harness.check_icount(ctx, self.name)
        variants = [v.with_patches(BENCH_PATCH)
                    for v in harness.pick(self.name, "zeroing", params.variants)]
        plan = self.plan(params, guest_script(params, orders), f"zerobench-{ctx.platform}",
                         icount=counts_instructions(ctx, params))
        if "bench.config" not in ctx.extra_fragments:
            print("zerobench: no --fragment bench.config: the patched kernels verify every "
                  "known-zero page, so on/off numbers are not representative", flush=True)
        records: dict[str, list[dict]] = {v: [] for v in params.variants}
        vmstat: dict[str, list[dict]] = {v: [] for v in params.variants}
        for booted in harness.rounds(ctx, variants, params.rounds, f"zerobench-{ctx.platform}",
                                     plan):
            r, s = self._guest(params, booted, orders)
            records[booted.variant.name] += r
            vmstat[booted.variant.name] += s
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data = summarise_run(params, orders, records, vmstat)
        data["platform"] = ctx.platform
        data["time_unit"] = unit
        ctx.save(f"zerobench-{ctx.platform}", data)
        return Outcome(self.name, data, render(params, orders, data, ctx.platform, unit))


def summarise_run(params: ZerobenchParams, orders: tuple[int, ...],
                  records: dict[str, list[dict]], vmstat: dict[str, list[dict]]) -> dict[str, Any]:
    """Result tree (units in the key names) from each variant's records."""
    variants = params.variants
    data: dict[str, Any] = {"params": asdict(params), "zero": {}, "fastpath": {}}
    zero = {v: zero_samples(records[v]) for v in variants}
    for order in orders:
        samples = {v: zero[v].get(order, []) for v in variants}
        entry: dict[str, Any] = {}
        for v in variants:
            skipped, missed = hit_counts(vmstat[v], order)
            entry[v] = {"alloc_ns_per_mib": summarise(samples[v]).as_dict(),
                        "pgzero_skipped": skipped, "pgzero_missed": missed,
                        "hit_rate": skipped / (skipped + missed) if skipped + missed else None,
                        "raw_alloc_ns_per_mib": samples[v]}
        # not off/vanilla: the stock kernel cannot flush, so whether the host
        # has discarded its pages yet depends on its reporting timer
        entry.update(ratios(samples, (("ratio_on_over_off", "off", "on"),)))
        data["zero"][str(order)] = entry
    mean = {v: fastpath_samples(records[v]) for v in variants}
    best = {v: fastpath_samples(records[v], best=True) for v in variants}
    for test in FASTPATH_TESTS:
        samples = {v: mean[v][test] for v in variants}
        fastest = {v: best[v][test] for v in variants}
        entry = {v: {"alloc_free_ns": summarise(samples[v]).as_dict(),
                     "raw_alloc_free_ns": samples[v]} for v in variants}
        for v in variants:
            if fastest[v]:
                entry[v]["best_chunk_alloc_free_ns"] = summarise(fastest[v]).as_dict()
                entry[v]["raw_best_chunk_alloc_free_ns"] = fastest[v]
        entry.update(ratios(samples, FASTPATH_PAIRS))
        entry.update({f"{k}_best_chunk": r for k, r in ratios(fastest, FASTPATH_PAIRS).items()})
        data["fastpath"][test] = entry
    return data


def render(params: ZerobenchParams, orders: tuple[int, ...], data: dict[str, Any],
           platform: str = "uml", unit: str = "ns") -> str:
    zero_rows: list[list[object]] = []
    for order in orders:
        entry = data["zero"][str(order)]
        for v in params.variants:
            hit = entry[v]["hit_rate"]
            zero_rows.append([order, v, spread(entry[v]["alloc_ns_per_mib"]),
                              "" if hit is None else f"{hit * 100:.1f}%",
                              entry[v]["alloc_ns_per_mib"]["n"]])
        for key, label in RATIO_LABELS.items():
            if key in entry:
                zero_rows.append([order, label, ratio_cell(entry[key]), "", ""])
    fast_rows: list[list[object]] = []
    for test, entry in data["fastpath"].items():
        for v in params.variants:
            s = entry[v]["alloc_free_ns"]
            b = entry[v].get("best_chunk_alloc_free_ns")
            fast_rows.append([test, v, f"{s['median']:.1f} [{s['p25']:.1f}-{s['p75']:.1f}]",
                              f"{b['median']:.1f} [{b['p25']:.1f}-{b['p75']:.1f}] min {b['min']:.1f}"
                              if b else "",
                              s["n"]])
        for key, label in RATIO_LABELS.items():
            if key in entry:
                b = entry.get(f"{key}_best_chunk")
                fast_rows.append([test, label, ratio_cell(entry[key]),
                                  ratio_cell(b) if b else "", ""])
    note = ("" if unit == "ns" else
            "; -icount shift=0: guest ns are executed instructions, so ns = instructions")
    return (f"zerobench zero ({platform}{note}; {params.bench_mib} MiB of __GFP_ZERO blocks "
            "after reporting dirty memory; ns per MiB median [p25-p75]; hit = zeroing "
            "skipped / zeroing "
            "allocations; vanilla cannot flush: its pages may not be discarded yet)\n"
            + table(["order", "variant", "ns/MiB", "hit", "n"], zero_rows)
            + f"\n\nzerobench fastpath ({platform}{note}; no __GFP_ZERO; "
            f"n={params.fastpath_n}; ns per "
            "alloc+free median [p25-p75] over the whole run and over its fastest chunk (and "
            "the fastest of all); "
            "ratios of medians with bootstrap 95% interval)\n"
            + table(["test", "variant", "ns/op", "best chunk ns/op", "n"], fast_rows))

"""zeroskip: populate memory the host discarded, with and without "never zero twice".

Variants, alternating in one run:
  vanilla  stock kernel (the overhead reference)
  off      patched kernel, reported pages not known zero (feature inactive)
  limit    (opt-in) the patched kernel plus a test-only patch that never
           zeroes user pages: how fast a populate could possibly be
  on       patched kernel, reported pages known zero: bit 6 negotiated
           with the patched QEMU of qemu/, or with vhost-user-balloon on
           UML (`off` there runs it without --x-device-init-reported).
Per mode and repetition: populate with data, free, report now (the
series' page_reporting.flush knob; the stock kernel waits for its 2 s
timer), then time a populate of the same size with every byte verified and
the pgzero_* vmstat counters read around it.

hugetlb-1g (x86 QEMU; populate_mib a multiple of 1024, a guest of about
three times that): gigantic pages have no surplus, so each populate gets
its own pool. The warm pool is freed to the buddy allocator before the
report, and the measured one is allocated inside the counted window,
since alloc_contig_range() is where a gigantic page learns that it is zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..guestshell import flush_if_present, pcp_high_fraction, thp, vmstat_delta, vmstat_save
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

# test-only: a kernel that never zeroes anonymous/THP/hugetlb user pages (unsafe)
LIMIT_PATCH = harness.LIMIT_PATCH
COUNTERS = ("pgzero_skipped", "pgzero_missed", "pgzero_marked_reported", "pgzero_merge_lost")


@dataclass
class ZeroskipParams:
    mem_mib: int = 1024
    populate_mib: int = 256
    modes: tuple[str, ...] = ("4k", "thp", "hugetlb")
    variants: tuple[str, ...] = ("vanilla", "off", "on")
    repeat: int = 3
    rounds: int = 2
    settle_s: int = 5
    pcp_high_fraction: int = 0
    timeout_s: int = 600


GIGANTIC_POOL = "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"


def gigantic_pool() -> str:
    """Shell function `gigantic_pool N`: size the 1 GiB pool, retrying while
    a range is busy for a moment (pages on their way to the free lists)."""
    return (f"gigantic_pool() {{ for try in 1 2 3 4 5; do echo $1 > {GIGANTIC_POOL}; "
            f"[ \"$(cat {GIGANTIC_POOL})\" = $1 ] && return 0; sleep 1; done; "
            "echo \"gigantic pool: $(cat " + GIGANTIC_POOL + ") of $1 pages\" >&2; exit 4; }")


def guest_script(p: ZeroskipParams, modes: tuple[str, ...]) -> str:
    lines = [
        thp("madvise"),
        f"echo {p.populate_mib // 2 + 8} > /proc/sys/vm/nr_overcommit_hugepages "
        "2>/dev/null || true",
    ]
    if p.pcp_high_fraction:
        lines.append(pcp_high_fraction(p.pcp_high_fraction))
    if "hugetlb-1g" in modes:
        lines.append(gigantic_pool())
    for mode in modes:
        gigantic = mode == "hugetlb-1g"
        pages = p.populate_mib // 1024
        for _ in range(p.repeat):
            lines += [
                *([f"gigantic_pool {pages}"] if gigantic else []),
                f"populate --mib {p.populate_mib} --mode {mode} --fill 0x5a --tag warm",
                *(["gigantic_pool 0"] if gigantic else []),
                flush_if_present(),
                f"sleep {p.settle_s}",
                vmstat_save(COUNTERS, "/tmp/v0"),
                *([f"gigantic_pool {pages}"] if gigantic else []),
                # exit 1 = non-zero bytes found: the host judges that (the limit
                # kernel produces them by design); any other failure stops the run
                f"populate --mib {p.populate_mib} --mode {mode} --touch --verify --tag measure"
                " || [ $? -eq 1 ]",
                vmstat_save(COUNTERS, "/tmp/v1"),
                *(["gigantic_pool 0"] if gigantic else []),
                # one JSON line with the counter deltas of that populate
                vmstat_delta(f',"mode":"{mode}"'),
            ]
    return "\n".join(lines) + "\n"


class Zeroskip(Scenario):
    name = "zeroskip"
    Params = ZeroskipParams
    platforms = ("uml", "qemu")

    @staticmethod
    def _guest(booted: harness.Booted) -> tuple[list[dict], list[dict]]:
        # the device zeroes (bit 6: the patched QEMU, vhost-user-balloon) for "on" only
        variant = booted.variant
        measured = [r for r in booted.records("populate") if r["tag"] == "measure"]
        # the limit kernel does not zero user memory at all: garbage is expected there
        bad = [r for r in measured if r["nonzero_bytes"] and variant.name != "limit"]
        if bad:
            raise booted.error(f"zeroskip: {bad[0]['nonzero_bytes']} non-zero bytes in a "
                              f"{bad[0]['mode']} populate: a page called zero was not")
        return measured, booted.records("vmstat")

    def run(self, ctx: RunContext, params: ZeroskipParams) -> Outcome:
        modes = tuple(m for m in params.modes if m in ctx.machine.populate_modes)
        if not modes:
            raise LabError(f"zeroskip on {ctx.platform} runs the "
                           f"{', '.join(ctx.machine.populate_modes)} modes only")
        variants = harness.pick(self.name, "zeroing", params.variants)
        plan = self.plan(params, guest_script(params, modes), f"zeroskip-{ctx.platform}")
        pops: dict[str, list[dict]] = {v: [] for v in params.variants}
        stats: dict[str, list[dict]] = {v: [] for v in params.variants}
        for booted in harness.rounds(ctx, variants, params.rounds, f"zeroskip-{ctx.platform}",
                                     plan):
            p, s = self._guest(booted)
            pops[booted.variant.name] += p
            stats[booted.variant.name] += s
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data: dict[str, Any] = {"platform": ctx.platform, "params": asdict(params), "modes": {}}
        rows = []
        for mode in modes:
            entry: dict[str, Any] = {}
            cpu = {v: [r["populate_cpu_ns"] / 1e6 for r in pops[v] if r["mode"] == mode]
                   for v in params.variants}
            wall = {v: [r["populate_ns"] / 1e6 for r in pops[v] if r["mode"] == mode]
                    for v in params.variants}
            # populate + a write to every page: where a host that discarded the
            # memory is paid, whether or not the guest zeroed it
            touched = {v: [(r["populate_ns"] + r.get("touch_ns", 0)) / 1e6
                           for r in pops[v] if r["mode"] == mode] for v in params.variants}
            for v in params.variants:
                counts = [r for r in stats[v] if r["mode"] == mode]
                skipped = sum(r.get("pgzero_skipped", 0) for r in counts)
                missed = sum(r.get("pgzero_missed", 0) for r in counts)
                entry[v] = {"populate_cpu_ms": summarise(cpu[v]).as_dict(),
                            "populate_wall_ms": summarise(wall[v]).as_dict(),
                            "populate_touch_wall_ms": summarise(touched[v]).as_dict(),
                            "pgzero_skipped": skipped, "pgzero_missed": missed,
                            "hit_rate": skipped / (skipped + missed) if skipped + missed else None,
                            "raw_cpu_ms": cpu[v]}
            if "on" in entry and "limit" in entry:
                entry["ratio_on_over_limit"] = median_ratio(cpu["limit"], cpu["on"]).as_dict()
                entry["ratio_on_over_limit_touch"] = median_ratio(touched["limit"],
                                                                  touched["on"]).as_dict()
            if "on" in entry and "off" in entry:
                entry["ratio_on_over_off"] = median_ratio(cpu["off"], cpu["on"]).as_dict()
                # UML's CPU clock ticks at HZ; wall time is fine-grained there
                entry["ratio_on_over_off_wall"] = median_ratio(wall["off"], wall["on"]).as_dict()
                entry["ratio_on_over_off_touch"] = median_ratio(touched["off"],
                                                                touched["on"]).as_dict()
            if "off" in entry and "vanilla" in entry:
                entry["ratio_off_over_vanilla"] = median_ratio(cpu["vanilla"], cpu["off"]).as_dict()
            data["modes"][mode] = entry
            for v in params.variants:
                s = entry[v]["populate_cpu_ms"]
                hit = entry[v]["hit_rate"]
                t = entry[v]["populate_touch_wall_ms"]
                rows.append([mode, v, f"{s['median']:.1f} [{s['p25']:.1f}-{s['p75']:.1f}]",
                             f"{t['median']:.1f} [{t['p25']:.1f}-{t['p75']:.1f}]",
                             "" if hit is None else f"{hit * 100:.0f}%", s["n"]])
            for key, label in (("ratio_on_over_off", "on/off"),
                               ("ratio_on_over_off_wall", "on/off wall"),
                               ("ratio_on_over_off_touch", "on/off +touch"),
                               ("ratio_on_over_limit", "on/limit"),
                               ("ratio_on_over_limit_touch", "on/limit +touch"),
                               ("ratio_off_over_vanilla", "off/vanilla")):
                if key in entry:
                    r = entry[key]
                    rows.append([mode, label, fmt_ratio(r),
                                 "", "", ""])
        text = (f"zeroskip ({ctx.platform}, {params.populate_mib} MiB populate after reporting, "
                "populate CPU time ms median [p25-p75], hit = zeroing skipped / zeroing "
                "allocations; +touch = populate and a write to every page, wall ms)\n"
                + table(["mode", "variant", "populate cpu ms", "+touch wall ms", "hit", "n"], rows))
        ctx.save(f"zeroskip-{ctx.platform}", data)
        return Outcome(self.name, data, text)

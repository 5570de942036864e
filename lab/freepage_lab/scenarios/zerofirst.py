"""zerofirst: what the zero-first allocation policy costs the host.

With init_on_alloc=1 (many distributions' default) every allocation
clears its pages, so a policy that sends zeroing allocations to known zero
free blocks sends all of them to the blocks the host discarded after free
page reporting. The guest saves its clearing; the host faults the memory
back in and clears it itself, while free memory it still backs stays
unused.

Per iteration the guest
  1. populates and frees `reported_mib` of data and flushes reporting:
     that memory is discarded on the host and known zero in the guest,
  2. populates and frees `backed_mib` of data without reporting it: the
     host still backs it, the guest's free lists hold it in front,
  3. populates `work_mib` (4 KiB pages) right away, every byte verified.
The host samples its footprint around step 3.

Variants (init_on_alloc=1 on all):
  vanilla   stock 6.12
  tail      the series with zero-first taking reported blocks from the
            tail (kernel/bench/zero-first-reported.patch restores that)
  series    the series: reported blocks stay behind backed memory
Reported: host footprint growth over step 3 (MiB), the populate's CPU
time and populate + touch wall time (ms), and the share of zeroing the
guest skipped. Needs a balloon that zeroes reported pages (bit 6): the
patched QEMU on x86, vhost-user-balloon on UML.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..footprint import value_at
from ..guestshell import flush_if_present, pcp_high_fraction, thp, vmstat_delta, vmstat_save
from ..initramfs import EVENT
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

MIB = 1 << 20
POLICY_PATCH = harness.POLICY_PATCH
VARIANTS = tuple(harness.family("zerofirst"))
COUNTERS = ("pgzero_skipped", "pgzero_missed")


@dataclass
class ZerofirstParams:
    mem_mib: int = 1024
    reported_mib: int = 512
    backed_mib: int = 256
    work_mib: int = 192
    variants: tuple[str, ...] = VARIANTS
    iterations: int = 3
    rounds: int = 2
    pcp_high_fraction: int = 0
    timeout_s: int = 900


def guest_script(p: ZerofirstParams) -> str:
    lines = [thp("never")]
    if p.pcp_high_fraction:
        lines.append(pcp_high_fraction(p.pcp_high_fraction))
    for i in range(p.iterations):
        lines += [
            f"populate --mib {p.reported_mib} --mode 4k --fill 0x5a --tag reported",
            # stock has no flush: its 2 s timer reports within the sleep
            flush_if_present(),
            "sleep 4",
            f"populate --mib {p.backed_mib} --mode 4k --fill 0x5a --tag backed",
            vmstat_save(COUNTERS, "/tmp/v0"),
            f"echo {EVENT} work {i}",
            "sleep 0.3",
            f"populate --mib {p.work_mib} --mode 4k --touch --verify --tag work",
            f"echo {EVENT} done {i}",
            "sleep 0.5",
            vmstat_save(COUNTERS, "/tmp/v1"),
            vmstat_delta(),
            "sleep 3",
        ]
    return "\n".join(lines) + "\n"


@dataclass
class Sample:
    growth_mib: float
    cpu_ms: float
    touch_ms: float
    skipped: int
    missed: int


class Zerofirst(Scenario):
    name = "zerofirst"
    Params = ZerofirstParams
    platforms = ("uml", "qemu")
    needs = "a balloon that zeroes reported pages"

    @staticmethod
    def _guest(p: ZerofirstParams, guest: harness.Booted) -> list[Sample]:
        marks = [(guest.marks[f"work {i}"].line.t + 0.25, guest.marks[f"done {i}"].line.t + 0.45)
                 for i in range(p.iterations)]
        work = [r for r in guest.records("populate") if r["tag"] == "work"]
        bad = [r for r in work if r["nonzero_bytes"]]
        if bad:
            raise guest.error(f"zerofirst: {bad[0]['nonzero_bytes']} non-zero bytes: "
                              "a page called zero was not")
        counts = guest.records("vmstat")
        out = []
        for (t0, t1), r, c in zip(marks, work, counts):
            growth = value_at(guest.footprint, t1) - value_at(guest.footprint, t0)
            out.append(Sample(growth / MIB, r["populate_cpu_ns"] / 1e6,
                              (r["populate_ns"] + r.get("touch_ns", 0)) / 1e6,
                              c.get("pgzero_skipped", 0), c.get("pgzero_missed", 0)))
        return out

    def run(self, ctx: RunContext, params: ZerofirstParams) -> Outcome:
        runs: dict[str, list[Sample]] = {v: [] for v in params.variants}
        variants = harness.pick(self.name, "zerofirst", params.variants)
        # the same zeroing host for every variant: only the guest differs
        plan = self.plan(params, guest_script(params), f"zerofirst-{ctx.platform}",
                         cmdline=("init_on_alloc=1",),
                         marks=tuple(f"{m} {i}" for i in range(params.iterations)
                                     for m in ("work", "done")),
                         footprint_s=0.05)
        for booted in harness.rounds(ctx, variants, params.rounds, f"zerofirst-{ctx.platform}",
                                     plan):
            runs[booted.variant.name] += self._guest(params, booted)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data: dict[str, Any] = {"platform": ctx.platform, "params": asdict(params),
                                "variants": {}}
        rows = []
        for v in params.variants:
            s = runs[v]
            growth = summarise([x.growth_mib for x in s])
            cpu = summarise([x.cpu_ms for x in s])
            touch = summarise([x.touch_ms for x in s])
            skipped, missed = sum(x.skipped for x in s), sum(x.missed for x in s)
            hit = skipped / (skipped + missed) if skipped + missed else None
            data["variants"][v] = {
                "host_growth_mib": growth.as_dict(), "populate_cpu_ms": cpu.as_dict(),
                "populate_touch_wall_ms": touch.as_dict(), "pgzero_skipped_pages": skipped,
                "pgzero_missed_pages": missed, "skipped_share": hit,
                "raw_host_growth_mib": [x.growth_mib for x in s]}
            rows.append([v, f"{growth.median:.0f} [{growth.p25:.0f}-{growth.p75:.0f}]",
                         f"{cpu.median:.1f} [{cpu.p25:.1f}-{cpu.p75:.1f}]",
                         f"{touch.median:.1f} [{touch.p25:.1f}-{touch.p75:.1f}]",
                         "" if hit is None else f"{hit * 100:.0f}%", growth.n])
        for a, b in (("tail", "series"), ("vanilla", "series")):
            if a in runs and b in runs and runs[a] and runs[b]:
                r = median_ratio([x.touch_ms for x in runs[a]], [x.touch_ms for x in runs[b]])
                data[f"touch_ratio_{b}_over_{a}"] = r.as_dict()
                rows.append([f"{b}/{a} +touch", "", "", fmt_ratio(r), "", ""])
        text = (f"zerofirst ({ctx.platform}, init_on_alloc=1: {params.work_mib} MiB populated "
                f"with {params.backed_mib} MiB of backed and ~{params.reported_mib} MiB of "
                "reported free memory; host growth MiB, populate CPU ms and populate + "
                "touch wall ms: median [p25-p75]; skipped = zeroing the guest skipped)\n"
                + table(["variant", "host growth MiB", "populate cpu ms", "+touch wall ms",
                         "skipped", "n"], rows))
        spread = statistics.pstdev([x.growth_mib for s in runs.values() for x in s] or [0.0])
        data["host_growth_pstdev_mib"] = spread
        ctx.save(f"zerofirst-{ctx.platform}", data)
        return Outcome(self.name, data, text)

"""pagefault: a page_fault1-style loop, reporting off vs on.

The guest maps 128 MiB, writes every 4 KiB page, unmaps, for `seconds`;
faults per second is the figure. Free page reporting must not tax the
fault path itself (goal: within 1% of reporting off). Variants and
interleaving as in churn (default off, stock, freepage; UML runs the
loop at native speed, each fault a host round trip of its own).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ..context import RunContext
from ..guestshell import BALLOON_BOUND, reporting_snapshot
from ..initramfs import EVENT
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table
from .churn import measured_boots, spread


@dataclass
class PagefaultParams:
    mem_mib: int = 2048
    mib: int = 128
    seconds: int = 10
    variants: tuple[str, ...] = ("off", "stock", "freepage")
    repeat: int = 5
    settle_s: int = 10
    timeout_s: int = 300


def pagefault_script(p: PagefaultParams) -> str:
    return "\n".join([
        BALLOON_BOUND, reporting_snapshot(),
        f"sleep {p.settle_s}",
        "reporting before",
        f"echo {EVENT} start",
        f"pagefault --seconds {p.seconds} --mib {p.mib} --tag pagefault",
        f"echo {EVENT} done",
        "reporting after",
    ]) + "\n"


def faults_per_s(records: list[dict]) -> float:
    recs = [r for r in records if r.get("prog") == "pagefault"]
    if len(recs) != 1:
        raise LabError(f"pagefault: expected one pagefault record, got {len(recs)}")
    return float(recs[0]["faults_per_s"])


def summarise_pagefault(runs: dict[str, list[float]], baseline: str = "off") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v, xs in runs.items():
        if not xs:
            continue
        entry: dict[str, Any] = {"faults_per_s": summarise(xs).as_dict(), "raw": xs}
        if v != baseline and runs.get(baseline):
            entry[f"ratio_to_{baseline}"] = median_ratio(runs[baseline], xs).as_dict()
        out[v] = entry
    return out


class Pagefault(Scenario):
    name = "pagefault"
    Params = PagefaultParams

    def run(self, ctx: RunContext, params: PagefaultParams) -> Outcome:
        runs: dict[str, list[float]] = {v: [] for v in params.variants}
        delays: dict[str, list[int | None]] = {v: [] for v in params.variants}
        for boot in measured_boots(ctx, self.name, params, pagefault_script(params)):
            runs[boot.variant].append(faults_per_s(boot.records))
            delays[boot.variant].append(boot.current_delay_ms)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        summary = summarise_pagefault(runs)
        data: dict[str, Any] = {"platform": ctx.platform, "params": asdict(params),
                                "variants": summary, "current_delay_ms_after": delays}
        ctx.save(f"pagefault-{ctx.platform}", data)
        rows = []
        for v, e in summary.items():
            r = e.get("ratio_to_off")
            rows.append([v, spread(e["faults_per_s"]),
                         f"{statistics.pstdev(e['raw']) / e['faults_per_s']['median'] * 100:.1f}%",
                         fmt_ratio(r) if r else "-", e["faults_per_s"]["n"]])
        text = (f"pagefault ({ctx.platform}, {params.mib} MiB mapped, touched, unmapped for "
                f"{params.seconds} s per boot; faults/s median [min-max] over boots; ratio to "
                "off: median with bootstrap 95% interval)\n"
                + table(["variant", "faults/s", "stdev", "ratio to off", "boots"], rows))
        return Outcome(self.name, data, text)

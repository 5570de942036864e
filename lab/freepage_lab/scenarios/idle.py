"""idle: what free page reporting costs a guest that does nothing.

Each variant boots, settles (boot-time reporting ends), then idles for
`seconds`. Measured over that window: the guest's busy CPU time from its
/proc/stat (user + nice + system + irq + softirq), the series' own
reporting time (`time_us`) and passes, and the host CPU of the VMM
(its process group, plus vhost-user-balloon on UML). All as % of one
CPU. Goal: reporting uses <= 0.1% of a CPU in an idle guest.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..guestshell import BALLOON_BOUND, USER_HZ, cpustat_function, reporting_snapshot
from ..initramfs import EVENT
from ..shell import LabError
from ..stats import summarise
from . import Outcome, Scenario, table
from .churn import VARIANTS, Boot, measure, plan, spread

# guest /proc/stat "cpu" line: user nice system idle iowait irq softirq steal
BUSY_FIELDS = (0, 1, 2, 5, 6)


@dataclass
class IdleParams:
    mem_mib: int = 2048
    seconds: int = 60
    variants: tuple[str, ...] = VARIANTS
    repeat: int = 5
    settle_s: int = 10
    # the variants of a repeat idle side by side (idle guests hardly compete
    # for the host's CPUs); 0: one after the other
    parallel: bool = True
    timeout_s: int = 300


def idle_script(p: IdleParams) -> str:
    return "\n".join([
        BALLOON_BOUND, reporting_snapshot(), cpustat_function(),
        f"sleep {p.settle_s}",
        "reporting before", "cpustat before",
        f"echo {EVENT} start",
        f"sleep {p.seconds}",
        f"echo {EVENT} done",
        "reporting after", "cpustat after",
    ]) + "\n"


@dataclass
class IdleBoot:
    variant: str
    guest_busy_pct: float
    reporting_pct: float | None  # the series' time_us over the window
    passes: int | None
    host_vmm_pct: float
    window_s: float


def guest_busy_s(records: list[dict]) -> float:
    stats = {r["tag"]: r["ticks"] for r in records if r.get("prog") == "cpustat"}
    if "before" not in stats or "after" not in stats:
        raise LabError("idle: the guest printed no /proc/stat snapshots")
    return sum(stats["after"][i] - stats["before"][i] for i in BUSY_FIELDS) / USER_HZ


def idle_boot(boot: Boot) -> IdleBoot:
    w = boot.window_s
    rep = boot.reporting
    return IdleBoot(boot.variant, guest_busy_s(boot.records) / w * 100,
                    rep["time_us"] / 1e6 / w * 100 if rep else None,
                    rep["passes"] if rep else None,
                    (boot.vmm + boot.daemon).cpu_s / w * 100, w)


def summarise_idle(boots: list[IdleBoot], variants: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in variants:
        mine = [b for b in boots if b.variant == v]
        if not mine:
            continue
        entry: dict[str, Any] = {
            "boots": len(mine),
            "guest_busy_pct": summarise([b.guest_busy_pct for b in mine]).as_dict(),
            "host_vmm_pct": summarise([b.host_vmm_pct for b in mine]).as_dict()}
        rep = [b for b in mine if b.reporting_pct is not None]
        if rep:
            entry["reporting_pct"] = summarise([b.reporting_pct or 0.0 for b in rep]).as_dict()
            entry["passes"] = summarise([float(b.passes or 0) for b in rep]).as_dict()
        out[v] = entry
    return out


class Idle(Scenario):
    name = "idle"
    Params = IdleParams

    def run(self, ctx: RunContext, params: IdleParams) -> Outcome:
        variants = harness.pick(self.name, "reporting", params.variants)
        script = idle_script(params)
        boots: list[IdleBoot] = []
        # an initramfs per variant: side by side, one is not rewritten under another
        plans = {v.name: plan(script, f"idle-{ctx.platform}-{v.name}", params.mem_mib,
                              params.seconds + params.timeout_s) for v in variants}

        def one(variant: harness.Variant, rnd: int) -> Boot | None:
            booted = harness.boot(ctx, variant, f"idle-{ctx.platform}-{variant.name}-{rnd}",
                                  plans[variant.name])
            return None if booted is None else measure(booted)

        for variant in variants:  # build every kernel before anything boots
            harness.kernel(ctx, variant)
            ctx.initrd(plans[variant.name].initrd, script)
        for rnd in range(params.repeat):
            order = harness.order(variants, rnd, rotate=True)
            if params.parallel and not ctx.shell.dry_run:
                with ThreadPoolExecutor(max_workers=len(order)) as pool:
                    done = list(pool.map(one, order, [rnd] * len(order)))
            else:
                done = [one(v, rnd) for v in order]
            boots += [idle_boot(b) for b in done if b is not None]
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        summary = summarise_idle(boots, params.variants)
        data: dict[str, Any] = {"platform": ctx.platform, "params": asdict(params),
                                "variants": summary, "boots": [asdict(b) for b in boots]}
        ctx.save(f"idle-{ctx.platform}", data)
        rows = []
        for v, e in summary.items():
            rows.append([v, spread(e["guest_busy_pct"], "{:.3f}"),
                         spread(e["reporting_pct"], "{:.4f}") if "reporting_pct" in e else "-",
                         spread(e["passes"]) if "passes" in e else "-",
                         spread(e["host_vmm_pct"], "{:.3f}"), e["boots"]])
        side = "side by side" if params.parallel else "one after the other"
        text = (f"idle ({ctx.platform}, guest {params.mem_mib} MiB idle for {params.seconds} s "
                f"after a settle, the variants {side}; % of one CPU, median [min-max] over "
                "boots)\n"
                + table(["variant", "guest busy %", "reporting %", "passes", "host VMM %",
                         "boots"], rows))
        return Outcome(self.name, data, text)

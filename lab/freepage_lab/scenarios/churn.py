"""churn: what free page reporting costs a guest that allocates and frees in a loop.

A guest that maps, touches and unmaps 512 MiB over and over gets its
memory reported between iterations when reporting is eager: the host
discards it, and the next iteration faults it back in on the host too.
Stock 6.12 waits 2 s before a pass, so a fast loop mostly reuses memory
the host still backs; a 250 ms delay (one integrator's choice) doubled
such a loop's allocation time. The freepage series reports after 100 ms
but backs off (4x per pass, up to 16 s) when half of what a pass
reported is allocated again.

Variants, interleaved (each repeat boots every variant once, in an order
that rotates from repeat to repeat):
  off       stock 6.12, the balloon does not offer free page reporting
  stock     stock 6.12 defaults (2 s delay)
  stock250  stock 6.12 with a 250 ms delay (kernel/bench/stock-delay-250ms.patch)
  freepage  the series with its defaults
The balloon is the same device for every variant (UML: vhost-user-balloon
with --no-init-bits; QEMU: Debian's virtio-balloon), so only the guest's
reporting differs.

Per boot: the guest settles (boot-time reporting ends), then runs
`churn`; the host reads the VMM's faults and CPU time (/proc/<pid>/stat
of every process in the guest's group, children included, plus the
vhost-user-balloon daemon on UML) right before and after the loop.
Reported per variant: median [min-max] over boots of the per-iteration
alloc + touch time, guest minor faults, host faults and VMM CPU, and the
ratio to stock (bootstrap 95% interval).

This module also holds what pagefault and idle share: the variants, the
host probe and the guest's reporting counters.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..context import RunContext
from ..guestshell import BALLOON_BOUND, REPORTING_COUNTERS, reporting_snapshot
from ..initramfs import EVENT, EXIT
from ..procfs import Usage, group_usage, process_usage
from ..runners import GuestConfig
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

VARIANTS = ("off", "stock", "stock250", "freepage")
STOCK250_PATCH = "stock-delay-250ms.patch"


def check_variants(scenario: str, variants: Sequence[str], allowed: Sequence[str] = VARIANTS) -> None:
    for v in variants:
        if v not in allowed:
            raise LabError(f"{scenario}: unknown variant {v!r}; choose from {', '.join(allowed)}")


def rotation(variants: Sequence[str], rnd: int) -> list[str]:
    """Variant order of repeat `rnd`: each variant takes each position in turn."""
    k = rnd % len(variants) if variants else 0
    return [*variants[k:], *variants[:k]]


# -- one boot of one variant ---------------------------------------------------

@dataclass
class Boot:
    """What one boot measured between two console marks."""

    variant: str
    records: list[dict]
    vmm: Usage  # the guest's process group over the window
    daemon: Usage  # vhost-user-balloon (UML), zero under QEMU
    window_s: float
    reporting: dict[str, int] = field(default_factory=dict)  # counter deltas (series only)
    current_delay_ms: int | None = None


def reporting_delta(records: list[dict], before: str = "before",
                    after: str = "after") -> tuple[dict[str, int], int | None]:
    """Counter deltas between two `reporting` records, and the delay in force after."""
    recs = {r["tag"]: r for r in records if r.get("prog") == "reporting"}
    if before not in recs or after not in recs:
        return {}, None
    a, b = recs[before], recs[after]
    return ({k: int(b[k]) - int(a[k]) for k in REPORTING_COUNTERS},
            int(b["current_delay_ms"]))


def reporting_trace(records: list[dict]) -> list[dict]:
    """The counters a churn_script(trace_ms=...) printed during the loop, in order."""
    return [{"t_s": float(r["tag"][2:]), **{k: v for k, v in r.items() if k not in
                                              ("prog", "tag", "_t")}}
            for r in records if r.get("prog") == "reporting" and r["tag"].startswith("t=")]


def variant_config(ctx: RunContext, variant: str, initrd_name: str, script: str,
                   mem_mib: int) -> tuple[GuestConfig, bool]:
    """The guest config of a variant, and whether its balloon offers reporting."""
    if variant == "freepage":
        kernel = ctx.kernel(patched=True)
    elif variant == "stock250":
        kernel = ctx.kernel(patched=False, extra_patches=(STOCK250_PATCH,))
    else:
        kernel = ctx.kernel(patched=False)
    reporting = variant != "off"
    cfg = GuestConfig(kernel=kernel, initrd=ctx.initrd(initrd_name, script), mem_mib=mem_mib,
                      free_page_reporting=reporting)
    return cfg, reporting


def boot_variant(ctx: RunContext, variant: str, tag: str, initrd_name: str, script: str,
                 mem_mib: int, timeout_s: float,
                 marks: tuple[str, str] = ("start", "done")) -> Boot | None:
    """Boot one variant, run its script, measure the VMM between two console marks."""
    cfg, reporting = variant_config(ctx, variant, initrd_name, script, mem_mib)
    extra = ("--no-init-bits",) + (() if reporting else ("--no-reporting",))
    host = ctx.balloon_host(cfg, tag, extra)
    guest = ctx.runner().guest(tag, cfg, ctx.log(tag))
    if ctx.shell.dry_run:
        guest.start()
        return None
    with host, guest:
        probe = _daemon_probe(host)
        _, m0, _ = guest.wait_for(rf"^{EVENT} {marks[0]}$", timeout_s)
        vmm0, d0 = group_usage(guest.pid), probe()
        _, m1, _ = guest.wait_for(rf"^{EVENT} {marks[1]}$", timeout_s)
        vmm1, d1 = group_usage(guest.pid), probe()
        # the script's status, not the power-off: a UML tearing down 2 GiB
        # under load may take longer than wait_exit() grants; leaving the
        # context kills what is left
        _, _, m = guest.wait_for(rf"^{EXIT} (\d+)", timeout_s)
        rc = int(m.group(1))
    if rc != 0:
        raise guest.error(f"{tag}: guest script failed (exit {rc})")
    records = guest.json_records()
    delta, delay = reporting_delta(records)
    return Boot(variant, records, vmm1 - vmm0, d1 - d0, m1.t - m0.t, delta, delay)


def _daemon_probe(host: object) -> Callable[[], Usage]:
    proc = getattr(host, "proc", None)
    if proc is None:
        return Usage
    return lambda: process_usage(proc.pid)


# -- the churn scenario --------------------------------------------------------

@dataclass
class ChurnParams:
    mem_mib: int = 2048
    churn_mib: int = 512
    iterations: int = 10
    sleep_ms: int = 0
    variants: tuple[str, ...] = VARIANTS
    repeat: int = 5
    # boot-time reporting passes end before the loop starts
    settle_s: int = 10
    # series only: print the reporting counters every N ms during the loop
    # (a diagnostic: the sampler costs the guest some CPU); 0: off
    trace_ms: int = 0
    timeout_s: int = 600


def churn_script(p: ChurnParams) -> str:
    loop = (f"churn --mib {p.churn_mib} --iterations {p.iterations} --sleep-ms {p.sleep_ms} "
            "--tag churn")
    if p.trace_ms:
        pause = f"{p.trace_ms // 1000}.{p.trace_ms % 1000:03d}"
        loop = (f"( while :; do reporting \"t=$(cut -d' ' -f1 /proc/uptime)\"; sleep {pause}; "
                f"done ) & tracer=$!\n{loop}\nkill $tracer || true")
    return "\n".join([
        BALLOON_BOUND, reporting_snapshot(),
        f"sleep {p.settle_s}",
        "reporting before",
        f"echo {EVENT} start",
        loop,
        f"echo {EVENT} done",
        "reporting after",
    ]) + "\n"


@dataclass
class ChurnBoot:
    """One boot's churn loop, per iteration (medians over the loop's iterations)."""

    variant: str
    alloc_ms: float
    guest_faults: float
    host_faults: float
    vmm_cpu_ms: float
    loop_s: float
    alloc_ms_all: list[float]
    reporting: dict[str, int]
    current_delay_ms: int | None


def churn_boot(boot: Boot) -> ChurnBoot:
    recs = [r for r in boot.records if r.get("prog") == "churn"]
    if len(recs) != 1:
        raise LabError(f"churn ({boot.variant}): expected one churn record, got {len(recs)}")
    r = recs[0]
    n = int(r["iterations"])
    vmm = boot.vmm + boot.daemon
    return ChurnBoot(boot.variant, statistics.median(r["alloc_ms"]),
                     statistics.median(r["faults"]), boot.vmm.faults / n,
                     vmm.cpu_s * 1000 / n, r["wall_ms"] / 1000, list(r["alloc_ms"]),
                     boot.reporting, boot.current_delay_ms)


METRICS = (("alloc_ms", "alloc+touch ms"), ("guest_faults", "guest faults"),
           ("host_faults", "host faults"), ("vmm_cpu_ms", "VMM CPU ms"))


def summarise_churn(boots: Sequence[ChurnBoot], variants: Sequence[str],
                    baseline: str = "stock") -> dict[str, Any]:
    """Per variant and metric: summary over boots and the ratio to `baseline`."""
    out: dict[str, Any] = {}
    base = [b for b in boots if b.variant == baseline]
    for v in variants:
        mine = [b for b in boots if b.variant == v]
        if not mine:
            continue
        entry: dict[str, Any] = {"boots": len(mine),
                                 "loop_s": summarise([b.loop_s for b in mine]).as_dict()}
        for key, _ in METRICS:
            xs = [float(getattr(b, key)) for b in mine]
            entry[key] = summarise(xs).as_dict()
            if base and v != baseline:
                a = [float(getattr(b, key)) for b in base]
                if statistics.median(a):
                    entry[f"{key}_ratio_to_{baseline}"] = median_ratio(a, xs).as_dict()
        rep = [b for b in mine if b.reporting]
        if rep:
            entry["reporting"] = {k: statistics.median(b.reporting[k] for b in rep)
                                  for k in REPORTING_COUNTERS}
            entry["current_delay_ms_after"] = [b.current_delay_ms for b in rep]
        out[v] = entry
    return out


def spread(s: dict, fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def churn_table(summary: dict[str, Any], baseline: str = "stock") -> str:
    rows = []
    for v, e in summary.items():
        row: list[object] = [v]
        for key, _ in METRICS:
            row.append(spread(e[key], "{:.1f}" if key in ("alloc_ms", "vmm_cpu_ms") else "{:.0f}"))
        for key in ("alloc_ms", "host_faults", "vmm_cpu_ms"):
            r = e.get(f"{key}_ratio_to_{baseline}")
            row.append(fmt_ratio(r) if r else "-")
        rep = e.get("reporting")
        row.append(f"{rep['passes']:.0f}/{rep['reported_pages']:.0f}/{rep['reused_pages']:.0f}"
                   if rep else "-")
        row.append(e["boots"])
        rows.append(row)
    return table(["variant", *[label for _, label in METRICS], f"alloc/{baseline}",
                  f"host faults/{baseline}", f"VMM CPU/{baseline}",
                  "passes/reported/reused", "boots"], rows)


class Churn(Scenario):
    name = "churn"
    Params = ChurnParams

    def run(self, ctx: RunContext, params: ChurnParams) -> Outcome:
        check_variants(self.name, params.variants)
        script = churn_script(params)
        boots: list[ChurnBoot] = []
        traces: dict[str, list[dict]] = {}
        for rnd in range(params.repeat):
            for variant in rotation(params.variants, rnd):
                tag = f"churn-{ctx.platform}-{variant}-{rnd}"
                boot = boot_variant(ctx, variant, tag, f"churn-{ctx.platform}", script,
                                    params.mem_mib, params.timeout_s)
                if boot is not None:
                    boots.append(churn_boot(boot))
                    traces[tag] = reporting_trace(boot.records)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        summary = summarise_churn(boots, params.variants)
        data: dict[str, Any] = {"platform": ctx.platform, "params": asdict(params),
                                "variants": summary, "boots": [asdict(b) for b in boots]}
        if params.trace_ms:
            data["trace"] = traces
        ctx.save(f"churn-{ctx.platform}", data)
        short = [v for v, e in summary.items() if e["loop_s"]["min"] < 10]
        note = (f"\nnote: the loop lasted < 10 s in some boots of {', '.join(short)}"
                if short else "")
        text = (f"churn ({ctx.platform}, guest {params.mem_mib} MiB, {params.churn_mib} MiB x "
                f"{params.iterations} per boot; per iteration, median [min-max] over boots; "
                "ratios: median with bootstrap 95% interval; passes/reported/reused: "
                "the series' counters over the loop)\n" + churn_table(summary) + note)
        return Outcome(self.name, data, text)

"""churn: what free page reporting costs a guest that allocates and frees in a loop.

A guest that maps, touches and unmaps 512 MiB over and over gets its
memory reported between iterations when reporting is eager: the host
discards it, and the next iteration faults it back in on the host too.
Stock 6.12 waits 2 s before a pass, so a fast loop mostly reuses memory
the host still backs; a 250 ms delay (one integrator's choice) doubled
such a loop's allocation time. The freepage series reports after 100 ms
but backs off (4x per pass, up to 16 s) when half of what a pass
reported is allocated again.

Variants (harness.FAMILIES["reporting"]), interleaved (each repeat boots
every variant once, in an order that rotates from repeat to repeat):
  off       stock 6.12, the balloon does not offer free page reporting
  stock     stock 6.12 defaults (2 s delay)
  stock250  stock 6.12 with a 250 ms delay (kernel/bench/stock-delay-250ms.patch)
  freepage  the series with its defaults
  freepage-off  (when asked for) the series, the balloon does not offer
            reporting: the baseline that leaves the rest of the series out
The balloon is the same device for every variant (UML: vhost-user-balloon
without its experimental bits 6/7; QEMU: Debian's virtio-balloon), so only the guest's
reporting differs.

Per boot: the guest settles (boot-time reporting ends), then runs
`churn`; the host reads the VMM's faults and CPU time (/proc/<pid>/stat
of every process in the guest's group, children included, plus the
vhost-user-balloon daemon on UML) right before and after the loop.
Reported per variant: median [min-max] over boots of the per-iteration
alloc + touch time, guest minor faults, host faults and VMM CPU, and the
ratios to reporting off and to stock (bootstrap 95% interval).

This module also holds what pagefault and idle share: the boot plan, the
window between two marks and the guest's reporting counters.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from .. import harness
from ..context import RunContext
from ..guestshell import BALLOON_BOUND, REPORTING_COUNTERS, reporting_snapshot, reporting_tracer
from ..initramfs import EVENT
from ..procfs import Usage
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

# the "reporting" family of harness.FAMILIES, but for freepage-off (the
# series on a device without reporting), which runs when asked for
VARIANTS = tuple(v for v in harness.family("reporting") if v != "freepage-off")


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
    # the boot's name (its log, its trace)
    name: str = ""


def reporting_delta(records: list[dict], before: str = "before",
                    after: str = "after") -> tuple[dict[str, int], int | None]:
    """Counter deltas between two `reporting` records, and the delay in force
    after; a counter the kernel does not have (an older series) is left out."""
    recs = {r["tag"]: r for r in records if r.get("prog") == "reporting"}
    if before not in recs or after not in recs:
        return {}, None
    a, b = recs[before], recs[after]
    return ({k: int(b[k]) - int(a[k]) for k in REPORTING_COUNTERS
             if a.get(k) is not None and b.get(k) is not None},
            int(b["current_delay_ms"]))


def reporting_trace(records: list[dict]) -> list[dict]:
    """The counters a churn_script(trace_ms=...) printed during the loop, in order."""
    return [{"t_s": float(r["tag"][2:]), **{k: v for k, v in r.items() if k not in
                                              ("prog", "tag", "_t")}}
            for r in records if r.get("prog") == "reporting" and r["tag"].startswith("t=")]


def measure(booted: harness.Booted, marks: tuple[str, str] = ("start", "done")) -> Boot:
    """What a boot measured between two marks (host probes, reporting counters)."""
    vmm, daemon, window_s = booted.between(*marks)
    records = booted.records()
    delta, delay = reporting_delta(records)
    return Boot(booted.variant.name, records, vmm, daemon, window_s, delta, delay, booted.name)


def plan(script: str, initrd: str, mem_mib: int, timeout_s: float) -> harness.Plan:
    """Boot, run the script, measure between its start and done marks; the
    script's exit code suffices: a UML tearing down 2 GiB under load may take
    longer to power off than a boot is granted, and leaving kills it."""
    return harness.Plan(script, initrd=initrd, mem_mib=mem_mib, marks=("start", "done"),
                        timeout_s=timeout_s, poweroff=False)


class Comparison(Protocol):
    """The parameters churn and pagefault share."""

    mem_mib: int
    variants: tuple[str, ...]
    repeat: int
    timeout_s: int


def measured_boots(ctx: RunContext, scenario: str, params: Comparison,
                   script: str) -> Iterator[Boot]:
    """`script` on every variant of the reporting family that `params`
    names, `params.repeat` rounds, each variant in each position in turn;
    each boot measured between its start and done marks."""
    variants = harness.pick(scenario, "reporting", params.variants)
    tag = f"{scenario}-{ctx.platform}"
    boot_plan = plan(script, tag, params.mem_mib, params.timeout_s)
    return (measure(b) for b in harness.rounds(ctx, variants, params.repeat, tag, boot_plan,
                                               rotate=True))


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
        loop = f"{reporting_tracer(p.trace_ms)}\n{loop}\nkill $tracer || true"
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
                    baselines: Sequence[str] = ("off", "stock", "freepage-off")
                    ) -> dict[str, Any]:
    """Per variant and metric: summary over boots and the ratio to each of
    `baselines` that has boots (reporting off is what the goal is against),
    also paired: the k-th boot of a variant over the k-th of the baseline,
    which booted in the same round."""
    out: dict[str, Any] = {}
    for v in variants:
        mine = [b for b in boots if b.variant == v]
        if not mine:
            continue
        entry: dict[str, Any] = {"boots": len(mine),
                                 "loop_s": summarise([b.loop_s for b in mine]).as_dict()}
        for key, _ in METRICS:
            xs = [float(getattr(b, key)) for b in mine]
            entry[key] = summarise(xs).as_dict()
            for baseline in baselines:
                a = [float(getattr(b, key)) for b in boots if b.variant == baseline]
                if a and v != baseline and statistics.median(a):
                    entry[f"{key}_ratio_to_{baseline}"] = median_ratio(a, xs).as_dict()
                    paired = [x / y for x, y in zip(xs, a) if y]
                    if paired:
                        entry[f"{key}_paired_to_{baseline}"] = summarise(paired).as_dict()
        rep = [b for b in mine if b.reporting]
        if rep:
            entry["reporting"] = {k: statistics.median(b.reporting[k] for b in rep)
                                  for k in REPORTING_COUNTERS
                                  if all(k in b.reporting for b in rep)}
            entry["current_delay_ms_after"] = [b.current_delay_ms for b in rep]
        out[v] = entry
    return out


def spread(s: dict, fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def table_baseline(summary: dict[str, Any]) -> str:
    """The variant the table's ratios are to: reporting off if it was measured."""
    return "off" if "off" in summary else "stock"


def churn_table(summary: dict[str, Any], baseline: str = "stock") -> str:
    rows = []
    for v, e in summary.items():
        row: list[object] = [v]
        for key, _ in METRICS:
            row.append(spread(e[key], "{:.1f}" if key in ("alloc_ms", "vmm_cpu_ms") else "{:.0f}"))
        for key in ("alloc_ms", "host_faults", "vmm_cpu_ms"):
            r = e.get(f"{key}_ratio_to_{baseline}")
            p = e.get(f"{key}_paired_to_{baseline}")
            row.append((fmt_ratio(r) + (f", paired {spread(p, '{:.2f}')}" if p else ""))
                       if r else "-")
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
        boots: list[ChurnBoot] = []
        traces: dict[str, list[dict]] = {}
        for boot in measured_boots(ctx, self.name, params, churn_script(params)):
            boots.append(churn_boot(boot))
            traces[boot.name] = reporting_trace(boot.records)
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
                "the series' counters over the loop)\n"
                + churn_table(summary, table_baseline(summary)) + note)
        if "freepage-off" in summary:
            text += ("\nthe same, against the series on a device without reporting "
                     "(reporting's own cost):\n" + churn_table(summary, "freepage-off"))
        return Outcome(self.name, data, text)

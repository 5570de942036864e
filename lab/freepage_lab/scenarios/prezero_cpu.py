"""prezero_cpu: does kprezerod stay inside its CPU cap (cpu_percent)?

QEMU x86 (TCG, -icount shift=0,sleep=off: guest time counts executed
instructions, so host load does not move it), the series with
--fragment bench.config, which turns on CONFIG_SCHEDSTATS for
/proc/<pid>/schedstat: the scheduler's own runtime of kprezerod in ns,
from a TSC-based sched_clock(). That is independent of the throttle's
bookkeeping, and counts everything the thread does (scans, isolation,
put-back, its own sleeps' overhead), not only the clearing the throttle
times. (UML keeps that runtime in jiffies and ticks miss short slices,
which is why prezero_cost's CPU column proves nothing.)

Per window, in one boot: dirty `pool_mib` and free it, set cpu_percent
to the cap, enable pre-zeroing, sleep `window_s` with nothing else to
run, disable. The share is the runtime gained over the window's length.
The pool must outlast the window for the share to reach the cap:
"saturated" says the thread still had dirty memory at the end (it
cleared less than the pool). Caps rotate between repetitions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..guestshell import PREZERO_DIR, VMSTAT_ALL, kcpu_function, kcpu_snapshot, require_prezero
from ..initramfs import EVENT
from ..shell import LabError
from ..stats import summarise
from . import Outcome, Scenario, table


@dataclass
class PrezeroCpuParams:
    mem_mib: int = 2048
    pool_mib: int = 1536
    caps: tuple[int, ...] = (5, 10, 25)
    window_s: int = 1
    repeat: int = 5
    icount: bool = True
    timeout_s: int = 3600


def check_params(p: PrezeroCpuParams) -> None:
    """Refuses bad parameters; caps given as text (--param caps=5,10) become ints."""
    try:
        p.caps = tuple(int(c) for c in p.caps)
    except ValueError:
        raise LabError(f"prezero_cpu: caps must be whole numbers, not {p.caps}") from None
    if not p.caps or any(not 1 <= c <= 100 for c in p.caps):
        raise LabError(f"prezero_cpu: caps must be 1..100, not {p.caps}")
    if p.pool_mib >= p.mem_mib or p.window_s < 1 or p.repeat < 1:
        raise LabError("prezero_cpu: pool_mib below mem_mib, window_s >= 1, repeat >= 1")


def guest_script(p: PrezeroCpuParams) -> str:
    rest = (" uptime_ms $(awk '{printf \"%d\", $1 * 1000}' /proc/uptime) marked "
            f"$({VMSTAT_ALL} | awk '/^pgzero_marked_prezero /{{print $2}}')\"")
    lines = [kcpu_function(),
             require_prezero("prezero_cpu")]
    for rep in range(p.repeat):
        # rotated, so that no cap always comes first
        for cap in harness.order(p.caps, rep, rotate=True):
            lines += [
                f"populate --mib {p.pool_mib} --mode 4k --fill 0xa5 --tag pool >/dev/null",
                f"echo {cap} > {PREZERO_DIR}/cpu_percent",
                f"echo 1 > {PREZERO_DIR}/enabled",
                kcpu_snapshot(f"{EVENT} cpu {cap} {rep} start") + rest,
                f"sleep {p.window_s}",
                kcpu_snapshot(f"{EVENT} cpu {cap} {rep} end") + rest,
                f"echo 0 > {PREZERO_DIR}/enabled",
            ]
    return "\n".join(lines) + "\n"


@dataclass
class Window:
    cap: int
    share: float
    cleared_mib: float
    exact: bool


def windows(lines: list[str], pool_mib: int) -> list[Window]:
    """One Window per start/end pair of snapshots."""
    snaps: dict[tuple[int, int], dict[str, dict[str, int]]] = {}
    for line in lines:
        w = line.split()
        if len(w) >= 5 and w[0] == EVENT and w[1] == "cpu":
            vals = {k: int(v) for k, v in zip(w[5::2], w[6::2])}
            snaps.setdefault((int(w[2]), int(w[3])), {})[w[4]] = vals
    out = []
    for (cap, _rep), s in sorted(snaps.items()):
        if "start" not in s or "end" not in s:
            continue
        a, b = s["start"], s["end"]
        wall_ns = (b["uptime_ms"] - a["uptime_ms"]) * 1e6
        share = (b["cpu_ns"] - a["cpu_ns"]) / wall_ns if wall_ns > 0 else 0.0
        cleared = (b["marked"] - a["marked"]) / 256
        out.append(Window(cap, share, cleared, bool(a["exact"] and b["exact"])))
    return out


def summarise_run(p: PrezeroCpuParams, ws: list[Window]) -> dict[str, Any]:
    data: dict[str, Any] = {"params": asdict(p), "caps": {}}
    for cap in p.caps:
        mine = [w for w in ws if w.cap == cap]
        if not mine:
            continue
        data["caps"][str(cap)] = {
            "share": summarise([w.share for w in mine]).as_dict(),
            "over_cap": sum(w.share > cap / 100 for w in mine),
            "saturated": sum(w.cleared_mib < p.pool_mib for w in mine),
            "cleared_mib": summarise([w.cleared_mib for w in mine]).as_dict(),
            "exact": all(w.exact for w in mine),
            "raw_share": [w.share for w in mine]}
    return data


def render(data: dict[str, Any]) -> str:
    rows = []
    for cap, e in data["caps"].items():
        s, c = e["share"], e["cleared_mib"]
        rows.append([f"{cap}%", f"{s['median'] * 100:.2f}% [{s['min'] * 100:.2f}-"
                     f"{s['max'] * 100:.2f}]" + ("" if e["exact"] else " *"),
                     f"{s['median'] * 100 / int(cap):.2f}", e["over_cap"],
                     f"{e['saturated']}/{s['n']}", f"{c['median']:.0f}", s["n"]])
    p = data["params"]
    return (f"prezero_cpu (kprezerod's scheduler runtime over {p['window_s']} s windows with "
            f"nothing else to run, {p['pool_mib']} MiB dirty pool per window; median "
            "[min-max]; * = from ticks, not the scheduler)\n"
            + table(["cap", "CPU share", "share/cap", "windows over cap", "pool left at end",
                     "MiB cleared", "n"], rows))


class PrezeroCpu(Scenario):
    name = "prezero_cpu"
    Params = PrezeroCpuParams
    platforms = ("qemu",)
    needs = "UML's scheduler clock is jiffies"

    def run(self, ctx: RunContext, params: PrezeroCpuParams) -> Outcome:
        check_params(params)
        # harness.start() refuses -icount without TCG (kernel built first,
        # then QEMU)
        plan = self.plan(params, guest_script(params), "prezero-cpu", icount=params.icount)
        guest = harness.boot(ctx, harness.family("prezero_cpu")["series"], "prezero-cpu", plan)
        if guest is None:
            return Outcome(self.name, {}, "(dry run)")
        ws = windows(guest.lines, params.pool_mib)
        if not ws:
            raise guest.error("prezero_cpu: no complete window in the guest's output")
        data = summarise_run(params, ws)
        ctx.save("prezero-cpu", data)
        return Outcome(self.name, data, render(data))

"""prezero_cost: what pre-zeroing at its default rate costs a cache-sensitive workload.

UML (the kernel runs natively on the host CPU, real caches), the series
(with --fragment bench.config without its debug check, which reads pages
at allocation, never during the walk), no balloon. Variants,
interleaved per repetition (ABBA):
  off     pre-zeroing disabled
  nt      enabled, nocache=1: non-temporal stores (MOVNTI), the default
  cached  enabled, nocache=0: clear_page(), ordinary stores
cpu_percent stays at its default (10) in every variant.

Per boot, `walks` times: dirty `pool_mib` of memory and free it (a pool
of free pages that are not known zero), then run guest/cachewalk over a
working set of `wss_kib` (0: the host's last-level cache size) for
`walk_s` seconds, in bursts of `busy_ms` walking and `sleep_ms` asleep,
while kprezerod clears the pool. Around each walk the guest reads the
CPU time charged to kprezerod and pgzero_marked_prezero. The CPU time is
the scheduler's runtime in ns (/proc/<pid>/schedstat; bench.config turns
on CONFIG_SCHEDSTATS for it), or else utime + stime in ticks of 10 ms,
which undercount a thread that runs in slices shorter than a tick.

What this measures, and what not: a UML guest has one CPU. kprezerod is
SCHED_IDLE and gives the CPU up as soon as another task wants it, so it
runs while the walk sleeps, never during a burst. Pollution therefore
shows up as the walk's first pass over its working set after each sleep
("refill" ns per access): lines an ordinary-store clearing evicted must
come back from memory; non-temporal stores should leave them cached. The
whole burst ("walk") is what the workload loses. The host has no LLC
miss counters (no perf in this VM), so the walk's own time is the
measure. A guest with more vCPUs would clear on another core at the same
time as the walk runs; on a shared LLC that evicts the same lines, but
continuously: this setup shows the effect per sleep, not the overlap.
The host runs other work too: compare variants of one run only.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import harness
from ..context import RunContext
from ..guestshell import kcpu_function, kcpu_snapshot, prezero_helpers, require_prezero
from ..initramfs import EVENT
from ..shell import LabError, Shell
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

VARIANTS = tuple(harness.family("prezero_cost"))
NOCACHE = {"nt": 1, "cached": 0}
LLC = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")


def host_llc_kib(path: Path = LLC) -> int:
    """The host's last-level cache in KiB ("32768K"), 0 if unknown."""
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    mult = {"K": 1, "M": 1024}.get(text[-1:], 0)
    return int(text[:-1]) * mult if mult and text[:-1].isdigit() else 0


@dataclass
class PrezeroCostParams:
    mem_mib: int = 2048
    pool_mib: int = 1536
    wss_kib: int = 0
    walk_s: int = 2
    busy_ms: int = 10
    sleep_ms: int = 10
    walks: int = 3
    variants: tuple[str, ...] = VARIANTS
    repeat: int = 5
    timeout_s: int = 900
    # host CPU to run the guest on (-1: wherever the host likes)
    host_cpu: int = -1
    # 1: keep that host CPU busy with a SCHED_IDLE spinner while the guest
    # sleeps, so that it never halts and no other task (or, under a
    # hypervisor, no other VM) uses its caches meanwhile
    hold_cpu: int = 0


def guest_script(p: PrezeroCostParams, variant: str, wss_kib: int) -> str:
    lines = [
        prezero_helpers(),
        kcpu_function(),
        require_prezero("prezero_cost"),
    ]
    if variant in NOCACHE:
        lines += [f"knob nocache {NOCACHE[variant]}", "knob enabled 1"]
    for i in range(p.walks):
        snap = (kcpu_snapshot(f"{EVENT} window {i}")
                + " uptime_cs $(awk '{printf \"%d\", $1 * 100}' /proc/uptime) $(vm)\"")
        lines += [
            f"populate --mib {p.pool_mib} --mode 4k --fill 0xa5 --tag pool",
            snap,
            f"cachewalk --kib {wss_kib} --seconds {p.walk_s} --busy-ms {p.busy_ms} "
            f"--sleep-ms {p.sleep_ms} --tag {i}",
            snap,
        ]
    lines.append("knob enabled 0")
    return "\n".join(lines) + "\n"


@dataclass
class Walk:
    refill_ns: float
    walk_ns: float
    prezero_cpu_share: float
    marked_mib: float
    aborted_pages: int
    # the share comes from the scheduler's runtime, not from ticks
    cpu_exact: bool = True


def cpu_share(a: dict[str, int], b: dict[str, int]) -> tuple[float, bool]:
    """kprezerod's share of one CPU between two window snapshots, and whether
    both came from the scheduler's runtime (schedstat) rather than ticks."""
    wall_s = (b["uptime_cs"] - a["uptime_cs"]) / 100
    share = (b["cpu_ns"] - a["cpu_ns"]) / 1e9 / wall_s if wall_s > 0 else 0.0
    return share, bool(a["exact"] and b["exact"])


def windows(lines: list[str]) -> dict[int, list[dict[str, int]]]:
    """The two snapshots around each walk, by walk index."""
    out: dict[int, list[dict[str, int]]] = {}
    for line in lines:
        words = line.split()
        if len(words) >= 3 and words[0] == EVENT and words[1] == "window":
            out.setdefault(int(words[2]), []).append(
                {k: int(v) for k, v in zip(words[3::2], words[4::2])})
    return out


@contextmanager
def cpu_held(shell: Shell, cpu: int) -> Iterator[None]:
    """A SCHED_IDLE busy loop pinned to host CPU `cpu` for the duration: it
    runs only when nothing else wants that CPU, and touches no memory to
    speak of."""
    if shell.dry_run:
        print(f"$ chrt -i 0 taskset -c {cpu} sh -c 'while :; do :; done'")
        yield
        return
    proc = subprocess.Popen(["chrt", "-i", "0", "taskset", "-c", str(cpu), "sh", "-c",
                             "while :; do :; done"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(0.2)
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise LabError(f"prezero_cost: cannot hold host CPU {cpu}: {err or proc.returncode}")
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class PrezeroCost(Scenario):
    name = "prezero_cost"
    Params = PrezeroCostParams
    platforms = ("uml",)
    needs = "native caches"

    @staticmethod
    def _guest(guest: harness.Booted) -> list[Walk]:
        walks = {int(r["tag"]): r for r in guest.records("cachewalk")}
        out = []
        for i, (a, b) in sorted((k, v) for k, v in windows(guest.lines).items()
                                if len(v) == 2):
            share, exact = cpu_share(a, b)
            r = walks[i]
            out.append(Walk(r["refill_ns_per_access_median"], r["walk_ns_per_access_median"],
                            share,
                            (b["pgzero_marked_prezero"] - a["pgzero_marked_prezero"]) / 256,
                            b["pgzero_prezero_aborted"] - a["pgzero_prezero_aborted"], exact))
        return out

    def run(self, ctx: RunContext, params: PrezeroCostParams) -> Outcome:
        variants = harness.pick(self.name, "prezero_cost", params.variants)
        if params.pool_mib >= params.mem_mib:
            raise LabError("prezero_cost: pool_mib must be below mem_mib")
        ncpu = os.cpu_count() or 1
        if params.hold_cpu and params.host_cpu < 0:
            raise LabError("prezero_cost: hold_cpu=1 needs host_cpu")
        if params.host_cpu >= ncpu:
            raise LabError(f"prezero_cost: host_cpu={params.host_cpu}, the host has {ncpu} CPUs")
        wss = params.wss_kib or host_llc_kib() or 32768
        runs: dict[str, list[Walk]] = {v: [] for v in params.variants}
        held = cpu_held(ctx.shell, params.host_cpu) if params.hold_cpu else nullcontext()

        def plan(variant: harness.Variant) -> harness.Plan:
            return self.plan(params, guest_script(params, variant.name, wss),
                             f"prezero-cost-{variant.name}",
                             host_cpu=params.host_cpu if params.host_cpu >= 0 else None)

        with held:
            for booted in harness.rounds(ctx, variants, params.repeat, "prezero-cost", plan):
                runs[booted.variant.name] += self._guest(booted)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data = summarise_run(params, wss, runs)
        ctx.save("prezero-cost-uml", data)
        return Outcome(self.name, data, render(data, params.variants))


def summarise_run(p: PrezeroCostParams, wss_kib: int, runs: dict[str, list[Walk]]) -> dict[str, Any]:
    data: dict[str, Any] = {"params": asdict(p), "wss_kib": wss_kib, "variants": {}}
    for v, ws in runs.items():
        if not ws:
            continue
        data["variants"][v] = {
            "refill_ns_per_access": summarise([w.refill_ns for w in ws]).as_dict(),
            "walk_ns_per_access": summarise([w.walk_ns for w in ws]).as_dict(),
            "prezero_cpu_share": summarise([w.prezero_cpu_share for w in ws]).as_dict(),
            "marked_mib_per_walk": statistics.median(w.marked_mib for w in ws),
            "aborted_pages": sum(w.aborted_pages for w in ws),
            "cpu_source": "schedstat" if all(w.cpu_exact for w in ws) else "ticks",
            "raw_walk_ns_per_access": [w.walk_ns for w in ws]}
        if v != "off" and runs.get("off"):
            for key in ("refill", "walk"):
                data["variants"][v][f"{key}_over_off"] = median_ratio(
                    [getattr(w, f"{key}_ns") for w in runs["off"]],
                    [getattr(w, f"{key}_ns") for w in ws]).as_dict()
    return data


def render(data: dict[str, Any], variants: tuple[str, ...]) -> str:
    rows: list[list[object]] = []
    for v in variants:
        e = data["variants"].get(v)
        if not e:
            continue
        r, w, c = e["refill_ns_per_access"], e["walk_ns_per_access"], e["prezero_cpu_share"]
        rows.append([v, f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]",
                     fmt_ratio(e["refill_over_off"]) if "refill_over_off" in e else "",
                     f"{w['median']:.2f} [{w['min']:.2f}-{w['max']:.2f}]",
                     fmt_ratio(e["walk_over_off"]) if "walk_over_off" in e else "",
                     f"{c['median'] * 100:.1f}% [{c['min'] * 100:.1f}-{c['max'] * 100:.1f}]"
                     + ("" if e.get("cpu_source") == "schedstat" else " *"),
                     f"{e['marked_mib_per_walk']:.0f}", e["aborted_pages"], w["n"]])
    p = data["params"]
    return (f"prezero_cost (UML, cachewalk over {data['wss_kib']} KiB, {p['busy_ms']} ms busy / "
            f"{p['sleep_ms']} ms asleep, {p['walk_s']} s per walk, {p['pool_mib']} MiB dirty pool; "
            "ns per access median [min-max] over walks, ratio to off with bootstrap 95% interval; "
            "kprezerod CPU = its CPU time over the walk's wall time, cpu_percent=10; "
            "from the scheduler's runtime, which UML keeps in jiffies, or ticks where "
            "marked *)\n"
            + table(["variant", "refill ns", "refill/off", "walk ns", "walk/off",
                     "kprezerod CPU", "MiB cleared/walk", "aborted pages", "n"], rows))

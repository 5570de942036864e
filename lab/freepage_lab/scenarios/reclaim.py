"""reclaim: the guest populates X MiB, frees it; how fast does the host get it back?"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ..context import RunContext
from ..footprint import Reclaim, Sampler, analyse_reclaim
from ..initramfs import EVENT
from ..plot import timeline_plot
from ..runners import GuestConfig
from . import Outcome, Scenario, fmt_s, table

MIB = 1 << 20
BALLOON_BOUND = ("ls -d /sys/bus/virtio/drivers/virtio_balloon/virtio* >/dev/null 2>&1 || "
                 "{ echo 'no virtio_balloon device bound' >&2; exit 4; }")


@dataclass
class ReclaimParams:
    mem_mib: int = 2048
    populate_mib: int = 512
    modes: tuple[str, ...] = ("4k", "thp")
    repeat: int = 3
    settle_s: int = 15
    fill: int = 0xA5
    # vm.percpu_pagelist_high_fraction in the guest; 0 keeps the kernel's
    # default (per-cpu lists may hold 1/8 of a zone, and a UP kernel never
    # drains them when idle, so those 4 KiB pages are never reported)
    pcp_high_fraction: int = 0
    timeout_s: int = 300


def rounds_of(p: ReclaimParams) -> list[str]:
    """The mode of each populate/free round, in order."""
    return [m for m in p.modes for _ in range(p.repeat)]


def guest_script(p: ReclaimParams) -> str:
    lines = [BALLOON_BOUND, "echo 3 > /proc/sys/vm/drop_caches",
             "[ -w /sys/kernel/mm/transparent_hugepage/enabled ] && "
             "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled || true"]
    if p.pcp_high_fraction:
        lines.append(f"echo {p.pcp_high_fraction} > /proc/sys/vm/percpu_pagelist_high_fraction")
    for i, mode in enumerate(rounds_of(p)):
        lines += [
            f"populate --mib {p.populate_mib} --mode {mode} --fill {p.fill} --tag reclaim",
            f"echo {EVENT} freed {i}",
            f"sleep {p.settle_s}",
        ]
    return "\n".join(lines) + "\n"


class ReclaimScenario(Scenario):
    name = "reclaim"
    Params = ReclaimParams

    def run(self, ctx: RunContext, params: ReclaimParams) -> Outcome:
        cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("reclaim", guest_script(params)),
                          mem_mib=params.mem_mib)
        runner = ctx.balloon_runner(cfg)
        host = ctx.balloon_host(cfg, "balloon")
        guest = runner.guest("reclaim", cfg, ctx.log("reclaim"))
        if ctx.shell.dry_run:
            guest.start()
            return Outcome(self.name, {}, "(dry run)")
        with host, guest, Sampler(lambda: runner.footprint_bytes(guest)) as sampler:
            freed = []
            idx = 0
            for i in range(len(rounds_of(params))):
                idx, line, _ = guest.wait_for(rf"^{EVENT} freed {i}$", params.timeout_s, idx)
                freed.append(line.t)
            rc = guest.wait_exit(params.timeout_s)
        if rc != 0:
            raise guest.error(f"reclaim: guest script failed (exit {rc})")
        samples = sampler.samples
        freed_bytes = params.populate_mib * MIB
        bounds = [0.0, *freed[1:], float("inf")]
        rounds = [analyse_reclaim([s for s in samples if bounds[i] <= s.t < bounds[i + 1]],
                                  t, freed_bytes) for i, t in enumerate(freed)]
        t0 = guest.started
        data: dict[str, Any] = {
            "platform": ctx.platform,
            "params": asdict(params),
            "sample_rate_hz": sampler.rate_hz(),
            "rounds": [asdict(r) | {"t_freed_s": t - t0, "mode": m}
                       for r, t, m in zip(rounds, freed, rounds_of(params))],
            "timeline": {"t_s": [s.t - t0 for s in samples],
                         "footprint_mib": [s.bytes / MIB for s in samples]},
            "median": {mode: _summary([r for r, m in zip(rounds, rounds_of(params)) if m == mode])
                       for mode in params.modes},
        }
        label = f"reclaim-{ctx.platform}" + (f"-pcp{params.pcp_high_fraction}"
                                             if params.pcp_high_fraction else "")
        plot = ctx.run_dir / f"{label}.png"
        timeline_plot(plot, data["timeline"]["t_s"], data["timeline"]["footprint_mib"],
                      [t - t0 for t in freed],
                      f"reclaim on {ctx.platform}: {params.populate_mib} MiB freed, rounds "
                      + " ".join(rounds_of(params)))
        rows = [[i, m, f"{(r.before_bytes - r.after_bytes) / MIB:.0f}", fmt_s(r.t50_s),
                 fmt_s(r.t90_s), f"{r.fraction * 100:.0f}%", fmt_s(r.settled_s)]
                for i, (r, m) in enumerate(zip(rounds, rounds_of(params)))]
        for mode, med in data["median"].items():
            rows.append(["median", mode, f"{med['released_mib']:.0f}", fmt_s(med["t50_s"]),
                         fmt_s(med["t90_s"]), f"{med['fraction'] * 100:.0f}%", ""])
        pcp = (f", percpu_pagelist_high_fraction={params.pcp_high_fraction}"
               if params.pcp_high_fraction else "")
        text = (f"reclaim ({ctx.platform}, guest {params.mem_mib} MiB, {params.populate_mib} MiB "
                f"freed per round{pcp}, footprint sampled at {sampler.rate_hz():.0f} Hz)\n"
                + table(["round", "mode", "released MiB", "t50 s", "t90 s", "reclaimed",
                         "settled s"], rows))
        ctx.save(label, data)
        return Outcome(self.name, data, text, [str(plot)])


def _summary(rounds: list[Reclaim]) -> dict[str, float | None]:
    return {
        "t50_s": _median([r.t50_s for r in rounds]),
        "t90_s": _median([r.t90_s for r in rounds]),
        "fraction": statistics.median(r.fraction for r in rounds),
        "released_mib": statistics.median((r.before_bytes - r.after_bytes) / MIB for r in rounds),
    }


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if len(vals) == len(xs) and vals else None

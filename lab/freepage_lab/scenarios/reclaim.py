"""reclaim: the guest populates X MiB, frees it; how fast does the host get it back?"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ..context import RunContext
from ..footprint import Sampler, analyse_reclaim
from ..initramfs import EVENT
from ..plot import timeline_plot
from ..runners import GuestConfig
from ..shell import LabError
from . import Outcome, Scenario, fmt_s, table

MIB = 1 << 20


@dataclass
class ReclaimParams:
    mem_mib: int = 2048
    populate_mib: int = 512
    mode: str = "4k"
    repeat: int = 3
    settle_s: int = 15
    fill: int = 0xA5
    timeout_s: int = 300


def guest_script(p: ReclaimParams) -> str:
    lines = ["echo 3 > /proc/sys/vm/drop_caches"]
    for i in range(p.repeat):
        lines += [
            f"populate --mib {p.populate_mib} --mode {p.mode} --fill {p.fill} --tag reclaim",
            f"echo {EVENT} freed {i}",
            f"sleep {p.settle_s}",
        ]
    return "\n".join(lines) + "\n"


class ReclaimScenario(Scenario):
    name = "reclaim"
    Params = ReclaimParams

    def run(self, ctx: RunContext, params: ReclaimParams) -> Outcome:
        runner = ctx.runner()
        cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("reclaim", guest_script(params)),
                          mem_mib=params.mem_mib)
        backend = None
        if ctx.platform == "uml":
            from ..backend import BalloonBackend  # the host side for UML guests
            backend = BalloonBackend(ctx.shell, ctx.run_dir / "balloon.sock", ctx.log("backend"))
            cfg.vhost_user_balloon = backend.socket
        guest = runner.guest("reclaim", cfg, ctx.log("reclaim"))
        if ctx.shell.dry_run:
            guest.start()
            return Outcome(self.name, {}, "(dry run)")
        try:
            if backend is not None:
                backend.start()
            with guest, Sampler(lambda: runner.footprint_bytes(guest)) as sampler:
                freed = []
                idx = 0
                for i in range(params.repeat):
                    idx, line, _ = guest.wait_for(rf"^{EVENT} freed {i}$", params.timeout_s, idx)
                    freed.append(line.t)
                rc = guest.wait_exit(params.timeout_s)
            if rc != 0:
                raise LabError(f"reclaim: guest script failed (exit {rc}); see {guest.log_path}")
        finally:
            if backend is not None:
                backend.stop()
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
            "rounds": [asdict(r) | {"t_freed_s": t - t0} for r, t in zip(rounds, freed)],
            "timeline": {"t_s": [s.t - t0 for s in samples],
                         "footprint_mib": [s.bytes / MIB for s in samples]},
            "median": {
                "t50_s": _median([r.t50_s for r in rounds]),
                "t90_s": _median([r.t90_s for r in rounds]),
                "fraction": statistics.median(r.fraction for r in rounds),
                "released_mib": statistics.median((r.before_bytes - r.after_bytes) / MIB
                                                   for r in rounds),
            },
        }
        plot = ctx.run_dir / f"reclaim-{ctx.platform}.png"
        timeline_plot(plot, data["timeline"]["t_s"], data["timeline"]["footprint_mib"],
                      [t - t0 for t in freed],
                      f"reclaim on {ctx.platform}: {params.populate_mib} MiB freed x{params.repeat}")
        rows = [[i, f"{(r.before_bytes - r.after_bytes) / MIB:.0f}", fmt_s(r.t50_s),
                 fmt_s(r.t90_s), f"{r.fraction * 100:.0f}%", fmt_s(r.settled_s)]
                for i, r in enumerate(rounds)]
        rows.append(["median", f"{data['median']['released_mib']:.0f}",
                     fmt_s(data["median"]["t50_s"]), fmt_s(data["median"]["t90_s"]),
                     f"{data['median']['fraction'] * 100:.0f}%", ""])
        text = (f"reclaim ({ctx.platform}, guest {params.mem_mib} MiB, {params.populate_mib} MiB "
                f"{params.mode} freed, footprint sampled at {sampler.rate_hz():.0f} Hz)\n"
                + table(["round", "released MiB", "t50 s", "t90 s", "reclaimed", "settled s"], rows))
        ctx.save(f"reclaim-{ctx.platform}", data)
        return Outcome(self.name, data, text, [str(plot)])


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if len(vals) == len(xs) and vals else None

"""prezero_footprint: the host footprint of a reporting guest, pre-zeroing off vs on.

UML + vhost-user-balloon (free page reporting on, the daemon discards
what the guest reports), the series (--fragment bench.config). Per boot:
dirty `dirty_mib` and free it, flush reporting, settle `settle_s`, then
`window_s` seconds with pre-zeroing off and `window_s` seconds with it on
(min_order 0: every order below the reporting order, the only ones it may
take while a reporting device is registered). The host samples the
guest's footprint (allocated blocks of UML's memory file); growth over
each window is its last sample minus its first. Pre-zeroing must leave
reported blocks alone, so the "on" window must not grow more than the
"off" one. Repeated `repeat` times (one boot each) for the spread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..footprint import value_at
from ..guestshell import flush_if_present, pcp_high_fraction, prezero_helpers
from ..stats import summarise
from . import Outcome, Scenario, table
from .prezero import parse_events

MIB = 1 << 20


@dataclass
class PrezeroFootprintParams:
    mem_mib: int = 1024
    dirty_mib: int = 512
    settle_s: int = 10
    window_s: int = 60
    min_order: int = 0
    repeat: int = 3
    timeout_s: int = 600


def guest_script(p: PrezeroFootprintParams) -> str:
    return "\n".join([
        prezero_helpers(),
        pcp_high_fraction(1000),
        f"populate --mib {p.dirty_mib} --mode 4k --fill 0xa5 --tag dirty",
        flush_if_present(),
        f"sleep {p.settle_s}",
        f"knob min_order {p.min_order}",
        "ev off all",
        f"sleep {p.window_s}",
        "ev on all",
        "knob enabled 1",
        f"sleep {p.window_s}",
        "ev end all",
        "knob enabled 0",
    ]) + "\n"


@dataclass
class Window:
    off_growth_mib: float
    on_growth_mib: float
    footprint_mib: float
    marked_on: int
    marked_reported: int


class PrezeroFootprint(Scenario):
    name = "prezero_footprint"
    Params = PrezeroFootprintParams
    platforms = ("uml",)
    needs = "vhost-user-balloon, the memory file's blocks"

    def _guest(self, ctx: RunContext, p: PrezeroFootprintParams, rep: int) -> Window | None:
        plan = self.plan(p, guest_script(p), "prezero-footprint",
                         marks=("off all", "on all", "end all"), footprint_s=0.05)
        guest = harness.boot(ctx, harness.family("prezero_footprint")["series"],
                             f"prezero-footprint-{rep}", plan)
        if guest is None:
            return None
        marks = [guest.marks[f"{name} all"].line.t for name in ("off", "on", "end")]
        events = {name: c for name, _, c in parse_events(guest.lines)}
        fp = [value_at(guest.footprint, t) / MIB for t in marks]
        return Window(fp[1] - fp[0], fp[2] - fp[1], fp[2],
                      events["end"]["pgzero_marked_prezero"]
                      - events["on"]["pgzero_marked_prezero"],
                      events["end"].get("pgzero_marked_reported", 0))

    def run(self, ctx: RunContext, params: PrezeroFootprintParams) -> Outcome:
        got = [self._guest(ctx, params, rep) for rep in range(params.repeat)]
        ws = [w for w in got if w is not None]
        if ctx.shell.dry_run or not ws:
            return Outcome(self.name, {}, "(dry run)")
        data: dict[str, Any] = {
            "params": asdict(params),
            "off_growth_mib": summarise([w.off_growth_mib for w in ws]).as_dict(),
            "on_growth_mib": summarise([w.on_growth_mib for w in ws]).as_dict(),
            "footprint_mib": summarise([w.footprint_mib for w in ws]).as_dict(),
            "pgzero_marked_prezero_on": [w.marked_on for w in ws],
            "raw": [asdict(w) for w in ws]}
        ctx.save("prezero-footprint-uml", data)
        rows = [[i, f"{w.off_growth_mib:+.1f}", f"{w.on_growth_mib:+.1f}",
                 f"{w.footprint_mib:.1f}", w.marked_on, w.marked_reported]
                for i, w in enumerate(ws)]
        text = (f"prezero_footprint (UML + vhost-user-balloon, reporting on; {params.window_s} s "
                f"off then {params.window_s} s on, min_order {params.min_order}; host footprint "
                "growth per window, MiB; marked = pages pre-zeroed in the on window)\n"
                + table(["boot", "off growth", "on growth", "footprint at end", "marked",
                         "reported (boot)"], rows))
        return Outcome(self.name, data, text)

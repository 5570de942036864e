"""Scenarios: data-driven experiments, one module each, one interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .. import harness
from ..context import RunContext
from ..shell import LabError


@dataclass
class Outcome:
    """A scenario's result: JSON data (units in the key names), table, plots."""

    name: str
    data: dict[str, Any]
    table: str
    plots: list[str] = field(default_factory=list)


class Scenario(ABC):
    name: str
    Params: type
    # where it runs (platforms.PLATFORMS keys), and why not elsewhere
    platforms: tuple[str, ...] = ("uml", "qemu", "arm64")
    needs: str = ""

    @abstractmethod
    def run(self, ctx: RunContext, params: Any) -> Outcome: ...

    @staticmethod
    def plan(params: Any, script: str, initrd: str, **fields: Any) -> harness.Plan:
        """A guest of the size and time limit the parameters give (mem_mib,
        timeout_s) running `script`; `fields`: more harness.Plan fields."""
        return harness.Plan(script, initrd=initrd, **{"mem_mib": params.mem_mib,
                                                      "timeout_s": params.timeout_s, **fields})

    def params(self, overrides: dict[str, str]) -> Any:
        """Params dataclass from key=value strings, types taken from the defaults."""
        known = {f.name: f for f in fields(self.Params)}
        kwargs: dict[str, Any] = {}
        for key, raw in overrides.items():
            if key not in known:
                raise LabError(f"{self.name}: unknown parameter {key!r}; "
                               f"known: {', '.join(sorted(known))}")
            default = known[key].default
            try:
                if isinstance(default, bool):
                    if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(raw)
                    kwargs[key] = raw.lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    kwargs[key] = int(raw)
                elif isinstance(default, float):
                    kwargs[key] = float(raw)
                elif isinstance(default, tuple):
                    kwargs[key] = tuple(x for x in raw.split(",") if x)
                else:
                    kwargs[key] = raw
            except ValueError:
                raise LabError(f"{self.name}: bad value {raw!r} for {key}") from None
        return self.Params(**kwargs)


def registry() -> dict[str, Scenario]:
    from .churn import Churn
    from .idle import Idle
    from .migrate import Migrate
    from .pagefault import Pagefault
    from .prezero import Prezero
    from .prezero_cost import PrezeroCost
    from .prezero_cpu import PrezeroCpu
    from .prezero_footprint import PrezeroFootprint
    from .realloc import Realloc
    from .reclaim import ReclaimScenario
    from .reclaim_io import ReclaimIo
    from .scale import Scale
    from .split import Split
    from .vmcreate import Vmcreate
    from .zerobench import Zerobench
    from .zerofirst import Zerofirst
    from .zeromix import Zeromix
    from .zeroskip import Zeroskip

    return {s.name: s for s in (ReclaimScenario(), Realloc(), Migrate(), Zeroskip(), Zeromix(),
                                Zerobench(), Zerofirst(), Split(), Churn(), Pagefault(),
                                Idle(), Prezero(), PrezeroCost(), PrezeroCpu(),
                                PrezeroFootprint(), ReclaimIo(), Vmcreate(), Scale())}


def run(scenario: Scenario, ctx: RunContext, params: Any) -> Outcome:
    """Run a scenario on the context's platform, if it runs there."""
    if ctx.platform not in scenario.platforms:
        why = f" ({scenario.needs})" if scenario.needs else ""
        raise LabError(f"{scenario.name} runs on {' or '.join(scenario.platforms)}{why}, "
                       f"not {ctx.platform}")
    return scenario.run(ctx, params)


def get(name: str) -> Scenario:
    scenarios = registry()
    if name not in scenarios:
        raise LabError(f"unknown scenario {name!r}; choose one of {', '.join(scenarios)}")
    return scenarios[name]


def table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"

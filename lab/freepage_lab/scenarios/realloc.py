"""realloc: populate memory the host discarded (reported) vs memory it still backs.

Two guests alternate, identical but for the balloon's free page reporting.
Each first touches most of its RAM with data and frees it, so every later
populate lands on memory the host has backed once.  Then, per mode and
repetition: populate with data, free, wait long enough for reporting, and
time a populate of the same size.  On the reporting guest that populate
faults in pages the host must find and zero again ("double zeroing"); on the
other it only pays the guest's own zeroing.

With variants=backed,stock-backed (or all three) stock 6.12 runs the
backed guest too, interleaved: what the series' kernel costs a populate
where nothing produces zeroed pages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import harness
from ..context import RunContext
from ..guestshell import THP_ENABLED
from ..initramfs import EVENT
from ..plot import bar_plot
from ..shell import LabError
from ..stats import median_ratio, summarise
from . import Outcome, Scenario, table

VARIANTS = ("backed", "reported")
# ratios printed per mode, where both variants ran: (numerator, denominator)
RATIOS = (("reported", "backed"), ("backed", "stock-backed"))


@dataclass
class ReallocParams:
    mem_mib: int = 2048
    populate_mib: int = 512
    prefault_mib: int = 1536
    modes: tuple[str, ...] = ("4k", "thp")
    repeat: int = 3
    rounds: int = 2
    variants: tuple[str, ...] = VARIANTS
    wait_s: int = 7
    timeout_s: int = 600


def guest_script(p: ReallocParams) -> str:
    lines = [
        f"echo madvise > {THP_ENABLED}",
        f"populate --mib {p.prefault_mib} --mode 4k --fill 1 --tag prefault",
        f"sleep {p.wait_s}",
    ]
    for mode in p.modes:
        for _ in range(p.repeat):
            lines += [
                f"populate --mib {p.populate_mib} --mode {mode} --fill 0x5a --tag warm",
                f"sleep {p.wait_s}",
                f"populate --mib {p.populate_mib} --mode {mode} --verify --tag measure",
            ]
    lines.append(f"echo {EVENT} done")
    return "\n".join(lines) + "\n"


class Realloc(Scenario):
    name = "realloc"
    Params = ReallocParams
    platforms = ("qemu",)
    needs = "THP in the guest"

    def run(self, ctx: RunContext, params: ReallocParams) -> Outcome:
        plan = self.plan(params, guest_script(params), "realloc")
        ctx.initrd(plan.initrd, plan.script)
        variants = harness.pick(self.name, "realloc", params.variants)
        names = [v.name for v in variants]
        samples: dict[str, dict[str, list[dict]]] = {v: {m: [] for m in params.modes}
                                                     for v in names}
        for booted in harness.rounds(ctx, variants, params.rounds, "realloc", plan):
            for rec in booted.records("populate"):
                if rec["tag"] == "measure":
                    if rec["nonzero_bytes"]:
                        raise LabError(f"realloc: {rec['nonzero_bytes']} non-zero bytes in "
                                       f"freshly populated memory ({booted.guest.log_path})")
                    samples[booted.variant.name][rec["mode"]].append(rec)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data: dict = {"platform": ctx.platform, "params": asdict(params), "modes": {}}
        rows = []
        for mode in params.modes:
            ms = {v: [r["populate_ns"] / 1e6 for r in samples[v][mode]] for v in names}
            cpu = {v: [r["populate_cpu_ns"] / 1e6 for r in samples[v][mode]] for v in names}
            entry: dict = {
                "populate_ms": {v: summarise(ms[v]).as_dict() for v in names},
                "populate_cpu_ms": {v: summarise(cpu[v]).as_dict() for v in names},
                "raw_ms": ms,
            }
            for v in names:
                st = summarise(ms[v])
                rows.append([mode, v, f"{st.median:.0f} [{st.p25:.0f}-{st.p75:.0f}]", "", st.n])
            for a, b in RATIOS:
                if a in names and b in names:
                    ratio = median_ratio(ms[b], ms[a])
                    entry[f"ratio_{a}_over_{b}".replace("-", "_")] = ratio.as_dict()
                    cpu_ratio = median_ratio(cpu[b], cpu[a])
                    entry[f"cpu_ratio_{a}_over_{b}".replace("-", "_")] = cpu_ratio.as_dict()
                    rows.append([mode, f"{a}/{b}", "", f"{ratio} (CPU {cpu_ratio})", ""])
            data["modes"][mode] = entry
        plot = ctx.run_dir / "realloc.png"
        bar_plot(plot, {m: {v: data["modes"][m]["populate_ms"][v]["median"] for v in names}
                        for m in params.modes},
                 "populate time (ms, median)",
                 f"populate {params.populate_mib} MiB: host-backed vs reported memory")
        text = (f"realloc ({ctx.platform}, {params.populate_mib} MiB populate, median [p25-p75] "
                f"ms, ratio with bootstrap 95% CI)\n"
                + table(["mode", "variant", "populate ms", "ratio", "n"], rows))
        ctx.save("realloc", data)
        return Outcome(self.name, data, text, [str(plot)])

"""migrate: live migration of a mostly-free guest, with and without free page hinting.

The guest fills most of its RAM with non-zero data and frees it (QEMU sends
all-zero pages almost for free, so freed memory must hold data, as it does
in real workloads).  Free page reporting is off, so the freed memory stays
resident on the host; what the hint saves is then visible.  A source and a
destination QEMU migrate over loopback TCP; QEMU reports time, downtime and
bytes.  Workloads: an idle guest, and one that keeps dirtying 256 MiB.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass

from .. import harness
from ..context import RunContext
from ..initramfs import EVENT
from ..runners import Qmp
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

VARIANTS = ("no-hint", "hint")
MIB = 1 << 20


@dataclass
class MigrateParams:
    mem_mib: int = 1024
    fill_mib: int = 700
    dirty_mib: int = 256
    dirty_pace_ms: int = 1000
    workloads: tuple[str, ...] = ("idle", "dirty")
    rounds: int = 5
    max_bandwidth_mib_s: int = 4096
    downtime_limit_ms: int = 300
    auto_converge: bool = True
    cpu: str = ""  # QEMU -cpu model for both ends; "" = the runner's default
    timeout_s: int = 180


def guest_script(p: MigrateParams, workload: str) -> str:
    lines = [f"populate --mib {p.fill_mib} --mode 4k --fill 0xa5 --tag fill"]
    if workload == "dirty":
        lines.append(f"dirty --mib {p.dirty_mib} --pace-ms {p.dirty_pace_ms} &")
        lines.append("sleep 1")
    # the heartbeat proves the guest really runs on the destination afterwards
    lines += [f"echo {EVENT} ready", f"while true; do sleep 1; echo {EVENT} alive; done"]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Migrate(Scenario):
    name = "migrate"
    Params = MigrateParams
    platforms = ("qemu",)
    needs = "two QEMUs and live migration"

    def one(self, ctx: RunContext, params: MigrateParams, workload: str,
            variant: harness.Variant, rnd: int) -> dict:
        """Two guests on top of the harness: the source, and the destination
        it migrates to (-incoming); both end after the migration."""
        harness.runner(ctx, variant)
        plan = self.plan(params, guest_script(params, workload), f"migrate-{workload}",
                         cpu=params.cpu or None)
        ctx.initrd(plan.initrd, plan.script)
        port = free_port()
        tag = f"migrate-{workload}-{variant.name}-{rnd}"
        src_qmp, dst_qmp = ctx.run_dir / f"{tag}-src.qmp", ctx.run_dir / f"{tag}-dst.qmp"
        with harness.start(ctx, variant, f"{tag}-src", plan, qmp_socket=src_qmp) as src, \
                harness.start(ctx, variant, f"{tag}-dst", plan, qmp_socket=dst_qmp,
                              incoming=f"tcp:127.0.0.1:{port}") as dst:
            if src is None or dst is None:
                return {}
            src.mark("ready")
            qs, qd = Qmp(src_qmp), Qmp(dst_qmp)
            try:
                qs.execute("migrate-set-capabilities", capabilities=[
                    {"capability": "auto-converge", "state": params.auto_converge}])
                qs.execute("migrate-set-parameters",
                           **{"max-bandwidth": params.max_bandwidth_mib_s * MIB,
                              "downtime-limit": params.downtime_limit_ms})
                qs.execute("migrate", uri=f"tcp:127.0.0.1:{port}")
                deadline = time.monotonic() + params.timeout_s
                while True:
                    info = qs.execute("query-migrate")
                    assert isinstance(info, dict)
                    status = info.get("status")
                    if status == "completed":
                        break
                    if status in ("failed", "cancelled"):
                        raise LabError(f"{tag}: migration {status}: {info.get('error-desc', '')}")
                    if time.monotonic() > deadline:
                        qs.execute("migrate_cancel")
                        raise LabError(f"{tag}: migration did not complete in "
                                       f"{params.timeout_s} s (last status {status})")
                    time.sleep(0.1)
                # the source reports completion before the destination resumes
                deadline = time.monotonic() + 30
                while True:
                    state = qd.execute("query-status")
                    assert isinstance(state, dict)
                    if state.get("status") == "running":
                        break
                    if time.monotonic() > deadline:
                        raise LabError(f"{tag}: destination is {state.get('status')}, "
                                       "not running, 30 s after the source completed")
                    time.sleep(0.1)
                dst.guest.wait_for(rf"^{EVENT} alive$", 30)
            finally:
                qs.close()
                qd.close()
        for end in (src, dst):
            warnings = harness.kernel_warnings(end.booted.lines)
            if warnings:
                raise end.booted.error(f"kernel warned: {warnings[0].strip()}")
        ram = info.get("ram", {})
        return {
            "total_time_ms": info.get("total-time"),
            "downtime_ms": info.get("downtime"),
            "setup_time_ms": info.get("setup-time"),
            "transferred_mib": ram.get("transferred", 0) / MIB,
            "normal_pages": ram.get("normal"),
            "zero_pages": ram.get("duplicate"),
            "dirty_sync_count": ram.get("dirty-sync-count"),
        }

    def run(self, ctx: RunContext, params: MigrateParams) -> Outcome:
        variants = harness.pick(self.name, "migrate", VARIANTS)
        results: dict[str, dict[str, list[dict]]] = {
            w: {v: [] for v in VARIANTS} for w in params.workloads}
        failures: dict[str, dict[str, list[str]]] = {
            w: {v: [] for v in VARIANTS} for w in params.workloads}
        for rnd in range(params.rounds):
            for workload in params.workloads:
                for v in harness.order(variants, rnd):
                    variant = v.name
                    try:
                        rec = self.one(ctx, params, workload, v, rnd)
                    except LabError as exc:
                        # a crashed destination is a result, not a reason to stop
                        print(f"migrate {workload}/{variant} round {rnd}: FAILED: "
                              f"{str(exc).splitlines()[0]}", flush=True)
                        failures[workload][variant].append(str(exc).splitlines()[0])
                        continue
                    if rec:
                        results[workload][variant].append(rec)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data: dict = {"platform": ctx.platform, "params": asdict(params), "workloads": {}}
        rows: list[list[str]] = []
        metrics = ("total_time_ms", "downtime_ms", "transferred_mib")
        for w in params.workloads:
            entry: dict = {"raw": results[w], "failures": failures[w]}
            vals = {m: {v: [float(r[m]) for r in results[w][v]] for v in VARIANTS} for m in metrics}
            for m in metrics:
                entry[m] = {v: summarise(vals[m][v]).as_dict() for v in VARIANTS if vals[m][v]}
                if all(vals[m][v] for v in VARIANTS):
                    entry[m]["ratio_hint_over_no_hint"] = median_ratio(
                        vals[m]["no-hint"], vals[m]["hint"]).as_dict()
            data["workloads"][w] = entry
            for v in VARIANTS:
                cells = [f"{entry[m][v]['median']:.0f} [{entry[m][v]['p25']:.0f}-"
                         f"{entry[m][v]['p75']:.0f}]" if v in entry[m] else "-" for m in metrics]
                rows.append([w, v, *cells, f"{len(results[w][v])} ok, "
                                           f"{len(failures[w][v])} failed"])
            ratios = [entry[m].get("ratio_hint_over_no_hint") for m in metrics]
            if all(ratios):
                rows.append([w, "hint/no-hint", *[fmt_ratio(r)
                                                   for r in ratios if r], ""])
        text = (f"migrate ({ctx.platform}, guest {params.mem_mib} MiB, {params.fill_mib} MiB "
                "filled then freed, loopback; median [p25-p75])\n"
                + table(["workload", "variant", "total ms", "downtime ms", "transferred MiB", "runs"],
                        rows))
        ctx.save("migrate", data)
        return Outcome(self.name, data, text)

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

from ..context import RunContext
from ..initramfs import EVENT
from ..runners import GuestConfig, Qmp
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, abba, table

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

    def one(self, ctx: RunContext, params: MigrateParams, workload: str, variant: str, rnd: int) -> dict:
        runner = ctx.runner()
        initrd = ctx.initrd(f"migrate-{workload}", guest_script(params, workload))
        port = free_port()
        tag = f"migrate-{workload}-{variant}-{rnd}"
        common = dict(kernel=ctx.kernel(), initrd=initrd, mem_mib=params.mem_mib,
                      free_page_reporting=False, free_page_hint=(variant == "hint"),
                      cpu=params.cpu or None)
        src_cfg = GuestConfig(**common, qmp_socket=ctx.run_dir / f"{tag}-src.qmp")  # type: ignore[arg-type]
        dst_cfg = GuestConfig(**common, qmp_socket=ctx.run_dir / f"{tag}-dst.qmp",  # type: ignore[arg-type]
                              incoming=f"tcp:127.0.0.1:{port}")
        src = runner.guest(f"{tag}-src", src_cfg, ctx.log(f"{tag}-src"))
        dst = runner.guest(f"{tag}-dst", dst_cfg, ctx.log(f"{tag}-dst"))
        if ctx.shell.dry_run:
            src.start()
            dst.start()
            return {}
        with src, dst:
            src.wait_for(rf"^{EVENT} ready$", params.timeout_s)
            qs, qd = Qmp(src_cfg.qmp_socket), Qmp(dst_cfg.qmp_socket)  # type: ignore[arg-type]
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
                dst.wait_for(rf"^{EVENT} alive$", 30)
            finally:
                qs.close()
                qd.close()
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
        if ctx.platform != "qemu":
            raise LabError("migrate needs QEMU: run it with --platform qemu")
        results: dict[str, dict[str, list[dict]]] = {
            w: {v: [] for v in VARIANTS} for w in params.workloads}
        failures: dict[str, dict[str, list[str]]] = {
            w: {v: [] for v in VARIANTS} for w in params.workloads}
        for rnd in range(params.rounds):
            for workload in params.workloads:
                for variant in abba(VARIANTS, rnd):
                    try:
                        rec = self.one(ctx, params, workload, variant, rnd)
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

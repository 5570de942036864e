"""migrate: live migration of a mostly-free guest, with and without free page hinting.

The guest fills most of its RAM with non-zero data and frees it (QEMU sends
all-zero pages almost for free, so freed memory must hold data, as it does
in real workloads).  Free page reporting is off except in "hint-reported",
so the freed memory stays resident on the host; what the hint saves is
then visible.  A source and a destination QEMU migrate over loopback TCP;
QEMU reports time, downtime and bytes.

Variants (harness.FAMILIES["migrate"]): stock 6.12 on Debian's QEMU without
and with hinting, the series on the patched QEMU without and with hinting,
and with hinting, reporting and the device's zeroing at once; and stock
6.12 on the patched QEMU without and with hinting ("qemu-patched",
"qemu-patched-hint"): with the switches below off, what the patched QEMU
changes for a guest that uses none of it.

Workloads: "idle"; "dirty", which keeps writing 256 MiB; "reuse", which
allocates, stamps, checks and frees 256 MiB over and over, reusing the
pages the guest hints (its bad pages must be 0: a page that lost what the
guest wrote fails the run), then populates verify_mib MiB that must read
zero (a page the guest took for known zero but that came across with
data fails the run).  Both workloads run for workload_s seconds
across the migration; their rate (passes or rounds per second) is the
workload's throughput. "compile" (platform qemu-debian: a Debian root
with gcc, on a qcow2 overlay both ends share, as shared storage) compiles
compile_objs objects of Linux 6.12's mm/ with `make -j<compile_jobs>`
(compilejob) twice after the free: once before the migration ("still")
and once with the migration starting compile_lead_s after the guest
says ready, a second into it ("migrated"); each compile's wall time (GNU time in the guest, and on the
host from its start to its JSON line on the console) and CPU time (user +
system of make and its children). With icount, both ends run QEMU TCG
with -icount shift=0, and the compile's wall time is the guest's: it
counts the instructions the vCPUs ran (and the idle time up to each
timer), so it is the guest's work alone, the same on a loaded host and a
quiet one; the host's threads of the migration and its downtime are not
in it.

A source on the patched QEMU switches over only after its first pass over
RAM has ended, and does not send RAM that reads as zero on its side (never
written, or discarded) to a destination that discarded its own: the series
puts them behind the experimental migration capabilities
x-switchover-after-first-pass (the source's) and x-skip-unpopulated-ram
(both ends'), off by default as in stock QEMU, which the scenario turns on
where the patched QEMU runs (switchover_after_first_pass=true,
skip_unpopulated=true, the defaults), as the series' figures were
measured; Debian's QEMU does not have them.

Modes: "precopy"; "postcopy" (postcopy-ram on both ends, switched to after
the first pass); "multifd" (multifd_channels channels).

RAM: private anonymous memory (QEMU's default), or with shared_memfd a
shared memfd on both ends (memory-backend-memfd,share=on), as a vhost-user
backend needs.

Used memory: the guest's RAM minus MemFree when the guest says "ready"
(after the free, with the workload running): what a migration that sent
only used memory would send.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import compilejob, guestshell, harness
from ..context import RunContext
from ..guest import Guest
from ..initramfs import EVENT
from ..procfs import host_available_mib
from ..runners import Qmp, check_host_room, qcow2_overlay
from ..shell import LabError
from ..stats import fmt_ratio, median_ratio, summarise
from . import Outcome, Scenario, table

VARIANTS = ("stock", "stock-hint", "no-hint", "hint", "hint-reported")
WORKLOADS = ("idle", "dirty", "reuse", "compile")
# workloads that need the Debian root (platforms.Platform.root)
ROOT_WORKLOADS = ("compile",)
MODES = ("precopy", "postcopy", "multifd")
MIB = 1 << 20
# the workloads' JSON line: program, and its count of units done
RATE = {"dirty": ("dirty", "passes"), "reuse": ("reuse", "rounds")}
# ratios printed per workload: (numerator, denominator)
RATIOS = (("hint", "no-hint"), ("hint", "stock"), ("hint-reported", "stock"),
          ("stock-hint", "stock"), ("qemu-patched", "stock"),
          ("qemu-patched-hint", "stock-hint"))


# the patched QEMU's migration capability: no switchover before the first
# pass over RAM has ended (qemu/first-pass-switchover; off unless set)
FIRST_PASS_CAP = "x-switchover-after-first-pass"
# the patched QEMU's migration capability of both ends: the source does not
# send RAM that reads as zero on its side, the destination discards the RAM
# it receives first (qemu/skip-unpopulated; off unless set)
ZERO_SKIP_CAP = "x-skip-unpopulated-ram"

# heartbeats (one a second) of the destination guest read for its free memory
DST_BEATS = 4


@dataclass
class MigrateParams:
    mem_mib: int = 1024
    fill_mib: int = 700
    dirty_mib: int = 256
    dirty_pace_ms: int = 1000
    reuse_mib: int = 256
    verify_mib: int = 512  # reuse: then a verified populate (0: none)
    workload_s: int = 30
    # compile only when asked for (it needs --platform qemu-debian)
    workloads: tuple[str, ...] = tuple(w for w in WORKLOADS if w not in ROOT_WORKLOADS)
    variants: tuple[str, ...] = VARIANTS
    modes: tuple[str, ...] = ("precopy",)
    rounds: int = 5
    max_bandwidth_mib_s: int = 4096
    downtime_limit_ms: int = 300
    auto_converge: bool = True
    multifd_channels: int = 2
    postcopy_after_ms: int = 100  # postcopy: switch this long after the start
    postcopy_bandwidth_mib_s: int = 0  # postcopy: max-postcopy-bandwidth (0: unlimited)
    cpu: str = ""  # QEMU -cpu model for both ends; "" = the runner's default
    shared_memfd: bool = False  # guest RAM in a shared memfd, as vhost-user needs
    # a source on the patched QEMU switches over after its first pass (FIRST_PASS_CAP)
    switchover_after_first_pass: bool = True
    # both ends on the patched QEMU skip RAM that reads as zero (ZERO_SKIP_CAP)
    skip_unpopulated: bool = True
    # a boot's wait to its ready and the migration's each get timeout_s,
    # plus timeout_s_per_gib for every GiB of guest RAM (timeout()): booting
    # and migrating a big guest under TCG take time that grows with its size
    timeout_s: int = 180
    timeout_s_per_gib: int = 8
    smp: int = 1  # vCPUs of both ends
    # compile: objects of mm/ (0: all), make's jobs, seconds after the
    # guest's ready (a second into the migrated compile) before the
    # migration starts, and how long a boot
    # may take to its migration (boot, fill, both compiles' set-up) and a
    # compile to its end
    compile_objs: int = 4
    compile_jobs: int = 2
    compile_lead_s: int = 4
    compile_timeout_s: int = 900
    # QEMU TCG -icount on both ends: guest time counts the instructions
    # the guest ran, so a compile's guest wall time is the guest's work,
    # not the host's load (the migration's own threads included)
    icount: bool = False


def timeout(p: MigrateParams) -> int:
    """How long a boot may take to its ready, and a migration to its end."""
    return p.timeout_s + p.timeout_s_per_gib * p.mem_mib // 1024


def compile_lines(p: MigrateParams) -> list[str]:
    """The compile workload: the tree and the compiler's programs read once
    (neither measured compile reads them from the disk first), the "still"
    compile, then the "migrated" one in the background."""
    return [compilejob.compile_shell(p.compile_jobs),
            f"find {compilejob.GUEST_DIR} -type f -exec cat {{}} + > /dev/null",
            'cat "$(gcc -print-prog-name=cc1)" $(command -v gcc make as) > /dev/null',
            f"compile_run still {p.compile_objs}",
            f"compile_run migrated {p.compile_objs} &"]


def guest_script(p: MigrateParams, workload: str, flush: bool) -> str:
    # fill_mib 0: a guest that only booted; the demo's 8 GiB step fills half and frees it
    lines = [f"populate --mib {p.fill_mib} --mode 4k --fill 0xa5 --tag fill"] if p.fill_mib else []
    if flush:
        # reporting on: the freed memory is reported (and discarded) first
        lines.append(guestshell.flush_cmd())
    if workload == "dirty":
        lines.append(f"dirty --mib {p.dirty_mib} --pace-ms {p.dirty_pace_ms} "
                     f"--seconds {p.workload_s} &")
    elif workload == "reuse":
        # then every page of a populate must read zero: a page the guest
        # took for known zero that came across with data would not
        verify = (f"; populate --mib {p.verify_mib} --mode 4k --verify --tag verify"
                  if p.verify_mib else "")
        lines.append(f"(reuse --mib {p.reuse_mib} --seconds {p.workload_s}{verify}) &")
    elif workload == "compile":
        lines += compile_lines(p)
    if workload != "idle":
        lines.append("sleep 1")
    free_kib = "$(awk '/^MemFree:/{print $2}' /proc/meminfo)"
    lines.append(f"echo {EVENT} ready used_kib=$(({p.mem_mib * 1024} - {free_kib}))")
    # the heartbeat proves the guest really runs on the destination
    # afterwards, and says whether it got the memory it hinted back
    lines.append(f"while true; do sleep 1; echo {EVENT} alive free_kib={free_kib}; done")
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def capabilities(p: MigrateParams, mode: str) -> list[dict]:
    caps = [{"capability": "auto-converge", "state": p.auto_converge}]
    if mode == "postcopy":
        caps.append({"capability": "postcopy-ram", "state": True})
        # the destination counts how long its vCPUs waited for pages
        caps.append({"capability": "postcopy-blocktime", "state": True})
    if mode == "multifd":
        caps.append({"capability": "multifd", "state": True})
    return caps


def patched_capabilities(p: MigrateParams, source: bool) -> list[dict]:
    """The patched QEMU's own capabilities of one end, as asked: the zero
    skip on both ends (ZERO_SKIP_CAP, which they must agree on), the
    switchover after the first pass (FIRST_PASS_CAP) on the source."""
    caps = [{"capability": ZERO_SKIP_CAP, "state": p.skip_unpopulated}]
    if source:
        caps.append({"capability": FIRST_PASS_CAP, "state": p.switchover_after_first_pass})
    return caps


def source_capabilities(p: MigrateParams, mode: str, patched_qemu: bool) -> list[dict]:
    """The source's capabilities: those of both ends, and on the patched
    QEMU its own (patched_capabilities())."""
    return capabilities(p, mode) + (patched_capabilities(p, True) if patched_qemu else [])


def destination_capabilities(p: MigrateParams, mode: str, patched_qemu: bool) -> list[dict]:
    """The destination's capabilities: those of both ends, and on the
    patched QEMU its own (patched_capabilities())."""
    return capabilities(p, mode) + (patched_capabilities(p, False) if patched_qemu else [])


def wait_status(qmp: Qmp, tag: str, done: tuple[str, ...], timeout_s: float,
                also: object = None) -> dict:
    """Poll query-migrate until its status is in `done` (or `also(info)`
    holds); a failed or cancelled migration, or the timeout, is an error."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = qmp.execute("query-migrate")
        assert isinstance(info, dict)
        status = info.get("status")
        if status in done or (also is not None and also(info)):  # type: ignore[operator]
            return info
        if status in ("failed", "cancelled"):
            raise LabError(f"{tag}: migration {status}: {info.get('error-desc', '')}")
        if time.monotonic() > deadline:
            qmp.execute("migrate_cancel")
            raise LabError(f"{tag}: migration did not complete in {timeout_s} s "
                           f"(last status {status})")
        time.sleep(0.05)


# how long a QEMU whose QMP connection dropped may take to finish exiting
EXIT_GRACE_S = 10


def destination_outcome(qmp: Qmp, guest: Guest, timeout_s: float) -> dict | None:
    """The destination's query-migrate once its status is completed or
    failed (wait_status()); None where it exited first (a destination that
    refuses the stream exits). A connection lost to a process that has not
    ended within EXIT_GRACE_S, or no outcome within `timeout_s`, is an
    error."""
    try:
        return wait_status(qmp, "destination", ("completed", "failed"), timeout_s)
    except LabError:
        if guest.ends_within(EXIT_GRACE_S):
            return None
        raise


def compile_fields(tag: str, still: dict, migrated: dict, still_t0: float,
                   migrated_t0: float, migrate_t0: float, migrate_t1: float) -> dict:
    """One boot's two compiles (their JSON lines, with `_t` the host's time
    of each line; `*_t0` the host's times of their starts) and the
    migration's start and end on the host: wall (guest and host) and CPU
    seconds of each, when the migration started into the migrated one,
    and whether that compile outlasted the migration. A compile that
    failed fails the run."""
    for rec in (still, migrated):
        if rec.get("rc") != 0:
            raise LabError(f"{tag}: the {rec.get('tag')} compile failed (make exit "
                           f"{rec.get('rc')}; the guest printed its last lines)")
    out: dict = {"compile_objs": migrated["objs"]}
    for name, rec, t0 in (("still", still, still_t0), ("migrated", migrated, migrated_t0)):
        out[f"compile_{name}_wall_s"] = float(rec["wall_s"])
        out[f"compile_{name}_cpu_s"] = float(rec["user_s"]) + float(rec["sys_s"])
        out[f"compile_{name}_host_s"] = rec["_t"] - t0
    out["compile_slowdown"] = out["compile_migrated_host_s"] / out["compile_still_host_s"]
    out["compile_guest_slowdown"] = (out["compile_migrated_wall_s"]
                                     / out["compile_still_wall_s"])
    out["compile_cpu_ratio"] = out["compile_migrated_cpu_s"] / out["compile_still_cpu_s"]
    out["migrate_into_compile_s"] = migrate_t0 - migrated_t0
    out["compile_covered"] = migrated["_t"] > migrate_t1
    return out


def compile_result(tag: str, src: harness.Running, dst: harness.Running, timeout_s: float,
                   migrate_t0: float, migrate_t1: float) -> dict:
    """compile_fields() of one boot: the still compile's line on the source's
    console, the migrated one's on the destination's, or on the source's
    where the compile ended before the switchover (called once the source
    reported the migration completed)."""
    starts = {}
    for name in ("still", "migrated"):
        _, line, _ = src.guest.wait_for(rf"^{EVENT} compile-start {name}$", 30)
        starts[name] = line.t

    def lines(end: harness.Running, tag: str) -> list[dict]:
        return [r for r in end.booted.records(compilejob.PROG) if r.get("tag") == tag]

    migrated = lines(src, "migrated")
    if not migrated:
        dst.guest.wait_for(rf'^{{"prog":"{compilejob.PROG}","tag":"migrated"', timeout_s)
        migrated = lines(dst, "migrated")
    still = lines(src, "still")
    if not still:
        raise src.booted.error(f"{tag}: no line of the still compile")
    return compile_fields(tag, still[-1], migrated[-1], starts["still"], starts["migrated"],
                          migrate_t0, migrate_t1)


# the compile's metrics per variant: (key, column), wall time on the host's
# clock, or on the guest's (-icount: the instructions the guest ran)
CPU_METRICS = (("compile_still_cpu_s", "still CPU s"), ("compile_migrated_cpu_s", "migrated CPU s"))
COMPILE_METRICS = {
    "host": (("compile_still_host_s", "still s"), ("compile_migrated_host_s", "migrated s"),
             *CPU_METRICS),
    "guest": (("compile_still_wall_s", "still guest s"),
              ("compile_migrated_wall_s", "migrated guest s"), *CPU_METRICS),
}
# each clock's migrated/still ratio of one boot (compile_fields())
SLOWDOWN = {"host": "compile_slowdown", "guest": "compile_guest_slowdown"}


def compile_report(names: list[str], by_variant: dict[str, list[dict]],
                   clock: str = "host") -> tuple[dict, list]:
    """The compile's figures over the boots of each variant: medians
    [p25-p75] of COMPILE_METRICS[clock], the paired migrated/still ratios
    of wall and CPU time (median with a bootstrap interval), how many
    migrations ended inside the compile; and for each pair of RATIOS the
    ratio of the variants' medians. `clock`: "host" (wall time on the
    host) or "guest" (the guest's own, which under -icount counts its
    instructions). Returns (data, table rows)."""
    metrics = COMPILE_METRICS[clock]
    data: dict = {"clock": clock, "variants": {}, "ratios": {}}
    rows: list[list[str]] = []
    for v in names:
        recs = [r for r in by_variant.get(v, []) if "compile_still_host_s" in r]
        if not recs:
            continue
        entry: dict = {k: summarise([float(r[k]) for r in recs]).as_dict()
                       for k, _ in metrics}
        # a ratio of each boot's own two compiles: the median of those,
        # bootstrapped (against a side of ones, whose median stays 1)
        for key, paired in ((SLOWDOWN[clock], "slowdown"), ("compile_cpu_ratio", "cpu_ratio")):
            xs = [float(r[key]) for r in recs]
            entry[paired] = median_ratio([1.0] * len(xs), xs).as_dict()
        entry["covered"] = sum(1 for r in recs if r["compile_covered"])
        data["variants"][v] = entry
        rows.append([v, *(f"{entry[k]['median']:.2f} [{entry[k]['p25']:.2f}-{entry[k]['p75']:.2f}]"
                          for k, _ in metrics),
                     fmt_ratio(entry["slowdown"]), fmt_ratio(entry["cpu_ratio"]),
                     f"{entry['covered']}/{len(recs)}"])
    for a, b in RATIOS:
        if a not in data["variants"] or b not in data["variants"]:
            continue
        ratios = {k: median_ratio([float(r[k]) for r in by_variant[b] if k in r],
                                  [float(r[k]) for r in by_variant[a] if k in r]).as_dict()
                  for k, _ in metrics}
        data["ratios"][f"{a}/{b}"] = ratios
        rows.append([f"{a}/{b}", *(fmt_ratio(ratios[k]) for k, _ in metrics),
                     "", "", ""])
    return data, rows


def compile_header(clock: str) -> list[str]:
    return ["variant", *(c for _, c in COMPILE_METRICS[clock]), "migrated/still",
            "CPU migrated/still", "migration inside"]


class Migrate(Scenario):
    name = "migrate"
    Params = MigrateParams
    platforms = ("qemu", "qemu-debian")
    needs = "two QEMUs and live migration"

    def migrate(self, p: MigrateParams, tag: str, mode: str, qs: Qmp, qd: Qmp,
                port: int, patched_qemu: bool = False) -> dict:
        """Migrate from `qs` to `qd`; `patched_qemu`: both ends run the
        patched QEMU (which has FIRST_PASS_CAP and ZERO_SKIP_CAP)."""
        # the destination waits (-incoming defer) until it has the same
        # capabilities: multifd must be set before it listens
        for q, caps in ((qs, source_capabilities(p, mode, patched_qemu)),
                        (qd, destination_capabilities(p, mode, patched_qemu))):
            q.execute("migrate-set-capabilities", capabilities=caps)
            if mode == "multifd":
                q.execute("migrate-set-parameters", **{"multifd-channels": p.multifd_channels})
        qd.execute("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
        qs.execute("migrate-set-parameters",
                   **{"max-bandwidth": p.max_bandwidth_mib_s * MIB,
                      "downtime-limit": p.downtime_limit_ms})
        if mode == "postcopy" and p.postcopy_bandwidth_mib_s:
            qs.execute("migrate-set-parameters",
                       **{"max-postcopy-bandwidth": p.postcopy_bandwidth_mib_s * MIB})
        qs.execute("migrate", uri=f"tcp:127.0.0.1:{port}")
        if mode == "postcopy":
            # switch while the first pass runs, hints arriving (a guest may
            # finish before: then it ran in precopy, and says so)
            time.sleep(p.postcopy_after_ms / 1000)
            qs.execute("migrate-start-postcopy")
        return wait_status(qs, tag, ("completed",), timeout(p))

    def one(self, ctx: RunContext, p: MigrateParams, mode: str, workload: str,
            variant: harness.Variant, rnd: int, source_args: tuple[str, ...] = ()) -> dict:
        """Two guests on top of the harness: the source, and the destination
        it migrates to (-incoming); both end after the migration.
        `source_args`: more QEMU arguments for the source (-trace, -D)."""
        harness.runner(ctx, variant)
        plan = self.plan(p, guest_script(p, workload, variant.reporting),
                         f"migrate-{workload}-{'flush' if variant.reporting else 'resident'}",
                         cpu=p.cpu or None, smp=p.smp, footprint_s=1.0, icount=p.icount,
                         timeout_s=max(timeout(p), p.compile_timeout_s)
                         if workload == "compile" else timeout(p))
        port = free_port()
        tag = f"migrate-{mode}-{workload}-{variant.name}-{rnd}"
        # short names: a socket's path must fit sun_path (108 bytes)
        self.boots = getattr(self, "boots", 0) + 1
        src_qmp, dst_qmp = (ctx.run_dir / f"m{self.boots}-src.qmp",
                            ctx.run_dir / f"m{self.boots}-dst.qmp")
        # a root disk: one overlay both ends open, as shared storage (each
        # end's own snapshot=on would lose what the source wrote)
        image = ctx.root_disk()
        overlay = (qcow2_overlay(ctx.shell, image, ctx.run_dir / f"m{self.boots}-root.qcow2")
                   if image is not None else None)
        disk = {"root_disk": overlay, "root_shared": True} if overlay is not None else {}
        try:
            return self.pair(ctx, p, mode, workload, variant, tag, plan, port,
                             (src_qmp, dst_qmp), disk, source_args)
        finally:
            if overlay is not None and not ctx.shell.dry_run:
                overlay.unlink(missing_ok=True)

    def pair(self, ctx: RunContext, p: MigrateParams, mode: str, workload: str,
             variant: harness.Variant, tag: str, plan: harness.Plan, port: int,
             qmp: tuple[Path, Path], disk: dict, source_args: tuple[str, ...]) -> dict:
        """The source and the destination of one migration; `disk`: their
        shared root disk (GuestConfig fields), or nothing."""
        src_qmp, dst_qmp = qmp
        with harness.start(ctx, variant, f"{tag}-src", plan, qmp_socket=src_qmp,
                           shared_memfd=p.shared_memfd,
                           extra_args=[*plan.extra_args, *source_args], **disk) as src, \
                harness.start(ctx, variant, f"{tag}-dst", plan, qmp_socket=dst_qmp,
                              shared_memfd=p.shared_memfd, incoming="defer", **disk) as dst:
            if src is None or dst is None:
                return {}
            ready = src.mark("ready")
            used_kib = int(ready.line.text.split("used_kib=")[1].split()[0])
            if workload == "compile":
                # the migration starts compile_lead_s after ready (the guest
                # says ready a second after the migrated compile started)
                time.sleep(max(0.0, p.compile_lead_s - (time.monotonic() - ready.line.t)))
            qs, qd = Qmp(src_qmp), Qmp(dst_qmp)
            compiled: dict = {}
            try:
                migrate_t0 = time.monotonic()
                info = self.migrate(p, tag, mode, qs, qd, port,
                                    harness.patched_qemu(ctx, variant))
                migrate_t1 = time.monotonic()
                dst_info = qd.execute("query-migrate")
                assert isinstance(dst_info, dict)
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
                # the destination guest has its memory back once it learnt the
                # migration is done: the most it had free in its first
                # DST_BEATS heartbeats (a workload holds memory in phases, and
                # reporting holds free blocks off the free lists while the host
                # discards them)
                dst_free_kib, after = 0, 0
                for _ in range(DST_BEATS):
                    i, beat, _ = dst.guest.wait_for(rf"^{EVENT} alive ", 30, after)
                    dst_free_kib = max(dst_free_kib,
                                       int(beat.text.split("free_kib=")[1].split()[0]))
                    after = i + 1
                rate = None
                if workload in RATE:
                    prog, unit = RATE[workload]
                    dst.guest.wait_for(rf'^{{"prog":"{prog}"', p.workload_s + 60)
                    rec = dst.booted.records(prog)[-1]
                    if prog == "reuse" and rec["bad_pages"]:
                        raise LabError(f"{tag}: reuse read back {rec['bad_pages']} bad pages "
                                       f"(first: round {rec['first_bad_round']}, page "
                                       f"{rec['first_bad_page']}, word {rec['first_bad_word']})")
                    rate = rec[unit] / rec["seconds"]
                    if prog == "reuse" and p.verify_mib:
                        dst.guest.wait_for(r'^\{"prog":"populate","tag":"verify"', 120)
                        check = dst.booted.records("populate")[-1]
                        if check["nonzero_bytes"]:
                            raise LabError(f"{tag}: {check['nonzero_bytes']} non-zero bytes in "
                                           f"{check['mib']} MiB of freshly populated memory")
                if workload == "compile":
                    compiled = compile_result(tag, src, dst, p.compile_timeout_s,
                                              migrate_t0, migrate_t1)
            finally:
                qs.close()
                qd.close()
        for end in (src, dst):
            warnings = harness.kernel_warnings(end.booted.lines)
            if warnings:
                raise end.booted.error(f"kernel warned: {warnings[0].strip()}")
        ram = info.get("ram", {})
        peak_mib = [max((s.bytes for s in end.booted.footprint), default=0) / MIB
                    for end in (src, dst)]
        return {
            "total_time_ms": info.get("total-time"),
            "downtime_ms": info.get("downtime"),
            "setup_time_ms": info.get("setup-time"),
            "transferred_mib": ram.get("transferred", 0) / MIB,
            "used_mib": used_kib / 1024,
            "dst_free_mib": dst_free_kib / 1024,
            # the most the host backed for each end (VmRSS, sampled each second)
            "src_peak_rss_mib": peak_mib[0],
            "dst_peak_rss_mib": peak_mib[1],
            "normal_pages": ram.get("normal"),
            "zero_pages": ram.get("duplicate"),
            "dirty_sync_count": ram.get("dirty-sync-count"),
            "postcopy_requests": ram.get("postcopy-requests"),
            # bytes sent after the switch to postcopy (0: it ran in precopy)
            "postcopy_mib": ram.get("postcopy-bytes", 0) / MIB,
            # postcopy: how long the destination's vCPUs waited for pages
            "postcopy_blocktime_ms": dst_info.get("postcopy-blocktime"),
            "workload_rate": rate,
            **compiled,
        }

    def run(self, ctx: RunContext, params: MigrateParams) -> Outcome:
        for what, got, known in (("mode", params.modes, MODES),
                                 ("workload", params.workloads, WORKLOADS)):
            bad = [x for x in got if x not in known]
            if bad or not got:
                raise LabError(f"migrate: unknown {what} {bad or list(got)}; "
                               f"choose from {', '.join(known)}")
        rooted = [w for w in params.workloads if w in ROOT_WORKLOADS]
        if rooted and not ctx.machine.root:
            raise LabError(f"migrate: workload {rooted[0]} runs in the Debian guest: "
                           "--platform qemu-debian")
        if rooted:
            # gcc, make and the compile's tree come with the tools root
            ctx = ctx.on(ctx.platform, root_tools=True)
        for name, least in (("smp", 1), ("compile_jobs", 1), ("compile_objs", 0),
                            ("compile_lead_s", 0)):
            if getattr(params, name) < least:
                raise LabError(f"migrate: {name} must be at least {least}, not "
                               f"{getattr(params, name)}")
        if params.icount:
            harness.check_icount(ctx, self.name)
        variants = harness.pick(self.name, "migrate", params.variants)
        if not ctx.shell.dry_run:
            # both ends at once, each writing its memmap and the fill
            check_host_room("migrate", [(params.mem_mib, params.fill_mib)] * 2,
                            host_available_mib())
        names = [v.name for v in variants]
        cells = [(m, w) for m in params.modes for w in params.workloads]
        results: dict[tuple[str, str], dict[str, list[dict]]] = {
            c: {v: [] for v in names} for c in cells}
        failures: dict[tuple[str, str], dict[str, list[str]]] = {
            c: {v: [] for v in names} for c in cells}
        for rnd in range(params.rounds):
            for mode, workload in cells:
                for v in harness.order(variants, rnd):
                    try:
                        rec = self.one(ctx, params, mode, workload, v, rnd)
                    except LabError as exc:
                        # a crashed destination is a result, not a reason to stop
                        print(f"migrate {mode}/{workload}/{v.name} round {rnd}: FAILED: "
                              f"{str(exc).splitlines()[0]}", flush=True)
                        failures[(mode, workload)][v.name].append(str(exc).splitlines()[0])
                        continue
                    if rec:
                        results[(mode, workload)][v.name].append(rec)
                        # each migration as it ends: a run cut short still says what it got
                        print(f"migrate {mode}/{workload}/{v.name} round {rnd}: "
                              f"total {rec['total_time_ms']} ms, downtime {rec['downtime_ms']} "
                              f"ms, sent {rec['transferred_mib']:.0f} MiB, used "
                              f"{rec['used_mib']:.0f} MiB, peak RSS {rec['src_peak_rss_mib']:.0f}"
                              f" / {rec['dst_peak_rss_mib']:.0f} MiB", flush=True)
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        return self.report(ctx, params, names, results, failures)

    def report(self, ctx: RunContext, params: MigrateParams, names: list[str],
               results: dict, failures: dict) -> Outcome:
        data: dict = {"platform": ctx.platform, "params": asdict(params), "cells": {}}
        rows: list[list[str]] = []
        compile_rows: dict[str, list] = {}
        clock = "guest" if params.icount else "host"
        metrics = ("total_time_ms", "downtime_ms", "transferred_mib", "used_mib",
                   "workload_rate")
        for (mode, w), by_variant in results.items():
            entry: dict = {"raw": by_variant, "failures": failures[(mode, w)], "ratios": {}}
            vals = {m: {v: [float(r[m]) for r in by_variant[v] if r.get(m) is not None]
                        for v in names} for m in metrics}
            for m in metrics:
                entry[m] = {v: summarise(vals[m][v]).as_dict() for v in names if vals[m][v]}
            for v in names:
                cells = [f"{entry[m][v]['median']:.0f} [{entry[m][v]['p25']:.0f}-"
                         f"{entry[m][v]['p75']:.0f}]" if v in entry[m] else "-"
                         for m in metrics[:4]]
                rate = entry["workload_rate"].get(v)
                cells.append(f"{rate['median']:.2f}" if rate else "-")
                rows.append([mode, w, v, *cells, f"{len(by_variant[v])} ok, "
                                                 f"{len(failures[(mode, w)][v])} failed"])
            for a, b in RATIOS:
                if a not in names or b not in names:
                    continue
                ratios = {m: median_ratio(vals[m][b], vals[m][a]).as_dict()
                          for m in metrics if vals[m][a] and vals[m][b]}
                if not ratios:
                    continue
                entry["ratios"][f"{a}/{b}"] = ratios
                rows.append([mode, w, f"{a}/{b}",
                             *[fmt_ratio(ratios[m]) if m in ratios else "" for m in metrics[:3]],
                             "", fmt_ratio(ratios["workload_rate"])
                             if "workload_rate" in ratios else "", ""])
            if w == "compile":
                entry["compile"], compile_rows[f"{mode}/{w}"] = compile_report(
                    names, by_variant, clock)
            data["cells"][f"{mode}/{w}"] = entry
        text = (f"migrate ({ctx.platform}, guest {params.mem_mib} MiB, {params.fill_mib} MiB "
                f"filled then freed, loopback, downtime-limit {params.downtime_limit_ms} ms; "
                "median [p25-p75]; used = RAM - MemFree; rate = the workload's passes or "
                "rounds per second; on the patched QEMU: "
                f"{FIRST_PASS_CAP} "
                f"{'on' if params.switchover_after_first_pass else 'off'} (source), "
                f"{ZERO_SKIP_CAP} {'on' if params.skip_unpopulated else 'off'} (both ends))\n"
                + table(["mode", "workload", "variant", "total ms", "downtime ms",
                         "sent MiB", "used MiB", "rate/s", "runs"], rows))
        for cell, crows in compile_rows.items():
            text += (f"\n\ncompile during the migration ({cell}: {params.compile_objs or 'all'} "
                     f"objects of Linux 6.12 mm/, make -j{params.compile_jobs}, {params.smp} "
                     f"vCPUs; the migration starts {params.compile_lead_s} s after the guest's ready, "
                     "which follows the migrated compile's start by about 1 s; "
                     + ("wall seconds of guest time, which -icount counts in instructions "
                        "(1 s: 1e9 instructions of the vCPUs), so neither the host's load nor "
                        "the downtime is in them"
                        if params.icount else "wall seconds on the host")
                     + ", CPU = user + system in the guest; "
                     "median [p25-p75], ratios with their bootstrap interval)\n"
                     + table(compile_header(clock), crows))
        ctx.save("migrate", data)
        return Outcome(self.name, data, text)

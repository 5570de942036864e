"""One way to boot a guest, for every scenario and every test.

    booted = harness.boot(ctx, variant, "reclaim-stock-0", plan)

builds the variant's kernel and the plan's initramfs, starts the balloon's
host side where the platform has one (vhost-user-balloon on UML), starts the
guest, waits for the plan's marks (console lines "FREEPAGE-EVENT <mark>"),
reads the host probes at each mark (the guest's process group and the
daemon: faults, CPU time), samples the footprint if asked, waits for the
script's exit, and fails the run on a non-zero exit code or a kernel
warning after boot. On a dry run it prints every command and returns None.

What is compared is a `Variant` (which kernel, which device on which QEMU,
which daemon flags); what is run is a `Plan` (the guest script and how to
watch it). Both are data; `FAMILIES` names the variants of every comparison.
`start()` is the same boot for callers that talk to the guest or the
daemon while it runs (tests, migration).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import platforms
from .backend import BalloonBackend
from .context import RunContext
from .footprint import Sample, Sampler
from .guest import ConsoleLine, Guest
from .initramfs import BOOTED, EVENT, EXIT
from .procfs import Usage, group_usage, process_usage
from .runners import GuestConfig, Runner
from .shell import LabError

# -- what is compared ----------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A guest kernel and the device and host side it boots with."""

    name: str
    # the series applied; None: what the run context says (--vanilla)
    patched: bool | None = None
    # test-only patches after the series (kernel/bench/, arm64-split/bench/)
    extra_patches: tuple[str, ...] = ()
    # a step of the series: its first N patches (0: all)
    series_patches: int = 0
    # a balloon device at all, and whether it offers free page reporting
    balloon: bool = True
    reporting: bool = True
    # the device zeroes reported and inflated pages and says so (bits 6 and
    # 7); None: what the context stands for (the series on the patched QEMU;
    # UML: the daemon's default, which offers them); never on Debian's QEMU
    zeroing: bool | None = False
    # free page hinting (QEMU, with an iothread)
    hint: bool = False
    # Debian's QEMU even with --patched-qemu: only the guest kernel differs
    stock_qemu: bool = False
    # QEMU with qemu/'s patch queue even without --patched-qemu
    patched_qemu: bool = False
    # vhost-user-balloon on QEMU (vhost-user-balloon-pci, patched QEMU)
    vhost_user: bool = False
    # more vhost-user-balloon arguments
    daemon_args: tuple[str, ...] = ()
    # more properties of QEMU's balloon device, as QEMU spells them
    device_props: tuple[str, ...] = ()

    def with_patches(self, *names: str) -> Variant:
        return replace(self, extra_patches=self.extra_patches + names)


# test-only kernel patches (kernel/bench/)
STOCK250_PATCH = "stock-delay-250ms.patch"
LIMIT_PATCH = "unsafe-no-user-page-zeroing.patch"
POLICY_PATCH = "zero-first-reported.patch"
# the series without its per-cpu zero lists: the zeroed state dropped there
PCP_DROP_PATCH = "pcp-drop.patch"

# the run context's kernel and device (--vanilla, --patched-qemu)
CONTEXT = Variant("context", zeroing=None)


def reporting_variants(off: dict[str, Any], **host: Any) -> tuple[Variant, ...]:
    """Stock kernels and the series on one host side (`host`: Variant
    fields), so only the guest's reporting differs; `off`: what else the
    device that does not offer reporting says."""
    return (
        Variant("off", patched=False, reporting=False, **host, **off),
        Variant("stock", patched=False, **host),
        Variant("stock250", patched=False, extra_patches=(STOCK250_PATCH,), **host),
        Variant("freepage", patched=True, **host),
    )


def zeroing_variants(on: dict[str, Any], **host: Any) -> tuple[Variant, ...]:
    """Stock 6.12, the series off and on, and the series with the unsafe
    limit patch (no clearing of user pages at all) on one host side
    (`host`: Variant fields); `on`: what else "on" has."""
    return (
        Variant("vanilla", patched=False, **host),
        Variant("off", patched=True, **host),
        Variant("on", patched=True, **{**host, **on}),
        Variant("limit", patched=True, extra_patches=(LIMIT_PATCH,), **host),
        # "on" with the per-cpu lists changed (kernel/bench/): the state
        # dropped there, or kept as membership of zero sublists
        Variant("pcp-drop", patched=True, extra_patches=(PCP_DROP_PATCH,), **{**host, **on}),
    )


FAMILIES: dict[str, dict[str, Variant]] = {name: {v.name: v for v in vs} for name, vs in {
    # free page reporting, as reclaim measured it (docs/results): Debian's
    # QEMU even with --patched-qemu, its "off" device names
    # free-page-reporting=off; on UML the daemon's defaults (it offers bits
    # 6 and 7, which only the series takes)
    "reclaim": reporting_variants({"device_props": ("free-page-reporting=off",)},
                                  stock_qemu=True, zeroing=None),
    # free page reporting under churn, page faults and idle: the context's
    # QEMU (--patched-qemu: the patched build, without bits 6 and 7), the
    # daemon without them; "freepage-off" (the series on a device that does
    # not offer reporting) tells reporting's cost from the rest of the
    # series', and runs only when asked for
    "reporting": (*reporting_variants({}),
                  Variant("freepage-off", patched=True, reporting=False)),
    # never zero twice: reported pages known zero (on) or not
    "zeroing": zeroing_variants({"zeroing": True}),
    # zeroing allocations on a zeroing device: the policy in the guest differs
    "zerofirst": (
        Variant("vanilla", patched=False, zeroing=True),
        Variant("tail", patched=True, extra_patches=(POLICY_PATCH,), zeroing=True),
        Variant("series", patched=True, zeroing=True),
    ),
    # pre-zeroing: no balloon, so every order may be pre-zeroed (the guest
    # script turns it on)
    "prezero": zeroing_variants({}, balloon=False),
    # pre-zeroing's cost: one kernel, the guest script sets the knobs
    "prezero_cost": (
        Variant("off", patched=True, balloon=False),
        Variant("nt", patched=True, balloon=False),
        Variant("cached", patched=True, balloon=False),
    ),
    # arm64 eager split: stock vs the arm64-split series, and its steps
    # (patches 1-3: the walk skips tables of pages; 1-4: the table builder;
    # 1-5: no split where write protection saw no block)
    "split": (
        Variant("stock", patched=False, balloon=False),
        Variant("p1-3", patched=True, balloon=False, series_patches=3),
        Variant("p1-4", patched=True, balloon=False, series_patches=4),
        Variant("p1-5", patched=True, balloon=False, series_patches=5),
        Variant("series", patched=True, balloon=False),
    ),
    # the context's kernel, the balloon with and without reporting
    "realloc": (
        Variant("backed", reporting=False, zeroing=None),
        Variant("reported", zeroing=None),
        # stock 6.12, memory backed: what the series costs where no
        # producer of zeroed pages is on (beside "backed", interleaved)
        Variant("stock-backed", patched=False, reporting=False, zeroing=None),
    ),
    # what reporting and pre-zeroing cost per GiB by guest size: the series
    # with the balloon reporting (the context's QEMU), and without a balloon,
    # so every free block is pre-zeroing's
    "scale": (
        Variant("reporting", patched=True),
        Variant("prezero", patched=True, balloon=False),
    ),
    # pre-zeroing's CPU cap, and its footprint beside a reporting balloon
    "prezero_cpu": (Variant("series", patched=True, balloon=False),),
    "prezero_footprint": (Variant("series", patched=True, zeroing=True),),
    # the kernel's mm selftests: stock and the series on one device (the
    # series' configurations differ only inside the guest: mmselftests.CONFIGS)
    "mm_selftests": (
        Variant("stock", patched=False, stock_qemu=True),
        Variant("series", patched=True, stock_qemu=True),
    ),
    # live migration with and without free page hinting: stock 6.12 on
    # Debian's QEMU, the series on the patched QEMU; reporting off (the
    # freed memory stays resident, what hinting saves shows), and once on
    # with the device zeroing, so hinting, reporting and known-zero pages
    # meet in one guest
    "migrate": (
        Variant("stock", patched=False, reporting=False, stock_qemu=True),
        Variant("stock-hint", patched=False, reporting=False, hint=True, stock_qemu=True),
        Variant("no-hint", patched=True, reporting=False, patched_qemu=True),
        Variant("hint", patched=True, reporting=False, hint=True, patched_qemu=True),
        Variant("hint-reported", patched=True, hint=True, zeroing=True, patched_qemu=True),
        # reporting and the device's zeroing alone: the freed memory is
        # discarded, what the migration does with discarded memory shows
        Variant("reported", patched=True, zeroing=True, patched_qemu=True),
        # stock 6.12 on the patched QEMU: beside "stock" and "stock-hint",
        # the same guest where only QEMU differs (its switches as asked)
        Variant("qemu-patched", patched=False, reporting=False, patched_qemu=True),
        Variant("qemu-patched-hint", patched=False, reporting=False, hint=True,
                patched_qemu=True),
    ),
}.items()}


def family(name: str) -> dict[str, Variant]:
    return FAMILIES[name]


def pick(scenario: str, family_name: str, names: Sequence[str]) -> list[Variant]:
    """The variants `names` of a family, in that order; unknown names fail."""
    known = FAMILIES[family_name]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise LabError(f"{scenario}: unknown variants {unknown or list(names)}; choose from "
                       f"{', '.join(known)}")
    return [known[n] for n in names]


def order(variants: Sequence[Any], rnd: int, rotate: bool = False) -> list[Any]:
    """The boot order of round `rnd`, so that drift hits every variant alike:
    A B C, then C B A, ... (ABBA), or with `rotate` each variant takes each
    position in turn (A B C, B C A, C A B)."""
    if rotate:
        k = rnd % len(variants) if variants else 0
        return [*variants[k:], *variants[:k]]
    return list(variants if rnd % 2 == 0 else variants[::-1])


# -- what is run -------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A guest script, the guest's size, and what to watch while it runs."""

    script: str
    # the initramfs' file name in the run directory ("" = the boot's name)
    initrd: str = ""
    mem_mib: int = 2048
    cmdline: tuple[str, ...] = ()
    # more VMM arguments (QEMU)
    extra_args: tuple[str, ...] = ()
    # console marks "FREEPAGE-EVENT <mark>" to wait for, in order
    marks: tuple[str, ...] = ()
    # each wait (boot to a mark, mark to mark, to the exit) gets this long
    timeout_s: float = 600
    # sample the host footprint / its THP backing every this many seconds
    footprint_s: float | None = None
    huge_s: float | None = None
    # guest time counts instructions (QEMU TCG -icount)
    icount: bool = False
    smp: int = 1
    # QEMU: NUMA nodes sharing the memory and the vCPUs (runners.numa_args)
    numa_nodes: int = 1
    cpu: str | None = None
    # UML: run the guest on this host CPU
    host_cpu: int | None = None
    # the guest must power off after its exit marker (False: the exit code
    # is enough; leaving kills what is left)
    poweroff: bool = True
    # the guest's console takes input (QEMU -serial stdio)
    interactive: bool = False
    # selftests suites the initramfs carries besides the arch's own (selftests.SUITES)
    selftests: tuple[str, ...] = ()


@dataclass
class Mark:
    """A console mark and the host probes read when it appeared."""

    line: ConsoleLine
    vmm: Usage  # the guest's process group
    daemon: Usage  # vhost-user-balloon (zero without one)


@dataclass
class Booted:
    """One boot: the guest (console, records), its exit code, marks, samples."""

    name: str
    variant: Variant
    guest: Guest
    runner: Runner
    rc: int = -1
    marks: dict[str, Mark] = field(default_factory=dict)
    footprint: list[Sample] = field(default_factory=list)
    huge: list[Sample] = field(default_factory=list)
    footprint_hz: float = 0.0

    @property
    def lines(self) -> list[str]:
        return [ln.text for ln in self.guest.lines]

    def records(self, prog: str | None = None) -> list[dict]:
        return self.guest.json_records(prog)

    def between(self, a: str, b: str) -> tuple[Usage, Usage, float]:
        """Host usage of the VMM and the daemon between two marks, and the seconds."""
        ma, mb = self.marks[a], self.marks[b]
        return mb.vmm - ma.vmm, mb.daemon - ma.daemon, mb.line.t - ma.line.t

    def error(self, why: str) -> LabError:
        return self.guest.error(why)


def kernel_warnings(lines: Sequence[str]) -> list[str]:
    """WARNING lines after boot (KUnit suites warn on purpose before init)."""
    booted = next((i for i, t in enumerate(lines) if t.startswith(BOOTED)), 0)
    return [t for t in lines[booted:] if "WARNING" in t]


def check(booted: Booted) -> Booted:
    """A guest script that failed or a kernel that warned after boot fails the run."""
    if booted.rc != 0:
        raise booted.error(f"guest script failed (exit {booted.rc})")
    warnings = kernel_warnings(booted.lines)
    if warnings:
        raise booted.error(f"kernel warned: {warnings[0].strip()}")
    return booted


def check_icount(ctx: RunContext, who: str) -> None:
    """-icount needs an emulated CPU (TCG): scenarios ask before anything is
    built, start() asks again for every plan with icount."""
    if not ctx.machine.icount:
        raise LabError(f"{who}: guest instruction counts need QEMU, not {ctx.platform}")
    accel = getattr(ctx.runner(), "accel", None)
    if accel != "tcg":
        raise LabError(f"{who}: -icount needs QEMU TCG, not {accel}: add --accel tcg "
                       "or --param icount=false")


def zeroing(ctx: RunContext, variant: Variant) -> bool:
    """Whether the device zeroes reported and inflated pages for this boot."""
    if variant.stock_qemu and ctx.machine.patched_qemu:
        return False  # Debian's QEMU cannot
    if variant.zeroing is None:
        return ctx.patched and ctx.patched_qemu
    return variant.zeroing


# vhost-user-balloon's experimental bits 6 and 7 (off unless asked for),
# named like the QEMU properties
DAEMON_INIT_REPORTED = "--x-device-init-reported"
DAEMON_INIT_ON_INFLATE = "--x-device-init-on-inflate"


def daemon_args(variant: Variant) -> list[str]:
    """vhost-user-balloon's arguments for a variant's device: bits 6 and 7
    unless the variant turns zeroing off (None: the context's device, which
    offers them), bit 6 only with the reporting queue it belongs to."""
    args = []
    if variant.zeroing is not False:
        args += [DAEMON_INIT_REPORTED] if variant.reporting else []
        args.append(DAEMON_INIT_ON_INFLATE)
    if not variant.reporting:
        args.append("--no-reporting")
    return args + list(variant.daemon_args)


def kernel(ctx: RunContext, variant: Variant) -> Path:
    """The variant's kernel image (built once per run)."""
    return ctx.kernel(patched=variant.patched, extra_patches=variant.extra_patches,
                      series_patches=variant.series_patches)


def guest_config(ctx: RunContext, variant: Variant, name: str, plan: Plan,
                 **overrides: Any) -> GuestConfig:
    """The variant's guest; `overrides` replace any GuestConfig field."""
    zero = zeroing(ctx, variant)
    cmdline = list(plan.cmdline)
    patched = ctx.patched if variant.patched is None else variant.patched
    if patched and variant.zeroing is not False:
        # the series takes the device's word only when told to
        cmdline = [*platforms.arch(ctx.arch).device_init_opt_in, *cmdline]
    cfg = GuestConfig(
        kernel=kernel(ctx, variant),
        initrd=ctx.initrd(plan.initrd or name, plan.script, plan.selftests),
        mem_mib=plan.mem_mib, cmdline=cmdline, extra_args=list(plan.extra_args),
        balloon=variant.balloon, free_page_reporting=variant.reporting,
        free_page_hint=variant.hint,
        # QEMU refuses bit 6 without the reporting queue it belongs to
        device_init_reported=ctx.machine.patched_qemu and zero and variant.reporting,
        device_init_on_inflate=ctx.machine.patched_qemu and zero,
        balloon_props=list(variant.device_props),
        cpu=plan.cpu, smp=plan.smp, numa_nodes=plan.numa_nodes, icount=plan.icount,
        host_cpu=plan.host_cpu, root_disk=ctx.root_disk())
    return replace(cfg, **overrides)


def patched_qemu(ctx: RunContext, variant: Variant) -> bool:
    """Whether the variant boots the build of qemu/'s patch queue: where the
    device must zero or --patched-qemu asks for it, unless it wants Debian's."""
    if variant.stock_qemu or not ctx.machine.patched_qemu:
        return False
    return (zeroing(ctx, variant) or ctx.patched_qemu or variant.vhost_user
            or variant.patched_qemu)


def runner(ctx: RunContext, variant: Variant) -> Runner:
    """The platform's runner; on QEMU the build patched_qemu() says."""
    return ctx.runner(patched_qemu=patched_qemu(ctx, variant))


class Running:
    """A guest being booted by start(): wait for its marks and its exit."""

    def __init__(self, booted: Booted, plan: Plan, backend: BalloonBackend | None) -> None:
        self.booted = booted
        self.plan = plan
        self.backend = backend
        self.guest = booted.guest
        self._index = 0

    def probe(self, line: ConsoleLine) -> Mark:
        daemon = (process_usage(self.backend.proc.pid)
                  if self.backend is not None and self.backend.proc is not None else Usage())
        return Mark(line, group_usage(self.guest.pid), daemon)

    def mark(self, name: str, timeout_s: float | None = None) -> Mark:
        """Wait for "FREEPAGE-EVENT <name>" after the last mark; probe the host."""
        pattern = rf"^{EVENT} {re.escape(name)}(?: |$)"
        self._index, line, _ = self.guest.wait_for(pattern, timeout_s or self.plan.timeout_s,
                                                   self._index)
        mark = self.booted.marks[name] = self.probe(line)
        return mark

    def wait_exit(self, timeout_s: float | None = None) -> int:
        """The script's exit code; with plan.poweroff, the guest must power off too."""
        timeout = timeout_s or self.plan.timeout_s
        if self.plan.poweroff:
            self.booted.rc = self.guest.wait_exit(timeout)
        else:
            _, _, m = self.guest.wait_for(rf"^{EXIT} (\d+)", timeout)
            self.booted.rc = int(m.group(1))
        return self.booted.rc


@contextmanager
def start(ctx: RunContext, variant: Variant, name: str, plan: Plan, *,
          run_with: Runner | None = None, daemon: BalloonBackend | None = None,
          **overrides: Any) -> Iterator[Running | None]:
    """Boot `variant` with `plan` and yield it running (None on a dry run,
    after printing every command); leaving kills the guest and stops the
    daemon. `overrides`: GuestConfig fields (qmp_socket, incoming, ...).
    `run_with`: the caller's runner (a QEMU build with test-only patches);
    `daemon`: a vhost-user-balloon the caller runs, which outlives the guest."""
    cfg = guest_config(ctx, variant, name, plan, **overrides)
    if plan.icount:
        check_icount(ctx, name)
    run_with = run_with or runner(ctx, variant)
    backend = daemon
    if (backend is None and variant.balloon
            and (ctx.machine.balloon_daemon or variant.vhost_user)):
        backend = BalloonBackend(ctx.shell, ctx.run_dir / f"{name}.sock",
                                 ctx.log(f"{name}-backend"), daemon_args(variant))
    if backend is not None:
        cfg.vhost_user_balloon = backend.socket
    guest = run_with.guest(name, cfg, ctx.log(name), interactive=plan.interactive)
    booted = Booted(name, variant, guest, run_with)
    with ExitStack() as stack:
        if backend is not None and backend is not daemon:
            stack.enter_context(backend)
        if ctx.shell.dry_run:
            guest.start()
            yield None
            return
        stack.enter_context(guest)
        samplers = []
        if plan.footprint_s:
            samplers.append(stack.enter_context(
                Sampler(lambda: run_with.footprint_bytes(guest), plan.footprint_s)))
        if plan.huge_s:
            samplers.append(stack.enter_context(
                Sampler(lambda: run_with.huge_backing_bytes(guest), plan.huge_s)))
        try:
            yield Running(booted, plan, backend)
        finally:
            stack.close()
            if plan.footprint_s:
                booted.footprint = samplers[0].samples
                booted.footprint_hz = samplers[0].rate_hz()
            if plan.huge_s:
                booted.huge = samplers[-1].samples


def rounds(ctx: RunContext, variants: Sequence[Variant], count: int, prefix: str,
           plan: Plan | Callable[[Variant], Plan], rotate: bool = False) -> Iterator[Booted]:
    """Boot every variant once a round, `count` rounds, each round in
    order() (ABBA, or rotated), each boot named "<prefix>-<variant>-<round>";
    yield the checked boots (a dry run prints their commands, yields none).
    `plan`: one for all, or each variant's own."""
    for rnd in range(count):
        for variant in order(variants, rnd, rotate):
            booted = boot(ctx, variant, f"{prefix}-{variant.name}-{rnd}",
                          plan if isinstance(plan, Plan) else plan(variant))
            if booted is not None:
                yield booted


def boot(ctx: RunContext, variant: Variant, name: str, plan: Plan) -> Booted | None:
    """Boot, wait for every mark and the exit, check exit code and warnings."""
    with start(ctx, variant, name, plan) as run:
        if run is None:
            return None
        for mark in plan.marks:
            run.mark(mark)
        run.wait_exit()
    return check(run.booted)

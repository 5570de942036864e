"""freepage: build kernels, boot guests, run scenarios, compare, demo."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import (
    demo,
    harness,
    hostcheck,
    insntrace,
    kernel,
    libvirtxml,
    mmselftests,
    packages,
    patchqueue,
    paths,
    prefixbuild,
    qemu,
    scenarios,
)
from . import guest as guest_mod
from .context import RunContext
from .demo import medians
from .initramfs import BOOTED
from .platforms import PLATFORMS
from .scenarios.zerobench import BENCH_PATCH
from .shell import LabError, Shell, StageResult

# `freepage boot`: the context's kernel (--vanilla) and QEMU (--patched-qemu),
# a balloon that does not zero
BOOT = harness.Variant("boot")
DEFAULT_BOOT_SCRIPT = """uname -a
grep -E 'MemTotal|MemFree' /proc/meminfo
ls /sys/bus/virtio/drivers/virtio_balloon 2>/dev/null | grep -q virtio && echo balloon: bound
populate --mib 16 --mode 4k --verify --tag boot
"""


def _parse_params(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise LabError(f"--param {item!r}: expected key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def cmd_build(args: argparse.Namespace, shell: Shell) -> int:
    arches = kernel.ARCHES if args.arch == "all" else (args.arch,)
    results = []
    for arch in arches:
        spec = kernel.BuildSpec(arch, args.variant, not args.vanilla, tuple(args.fragment),
                                tuple(args.patch))
        res, _ = kernel.build_stage(shell, spec)
        results.append(res)
    return report(results)


def cmd_series(args: argparse.Namespace, shell: Shell) -> int:
    if args.qemu:
        return cmd_qemu(args, shell)
    tree = Path(args.dir) if args.dir else paths.KERNEL_DIR / "tree"
    if args.action in ("tree", "export", "build-each"):
        # the top series of the x86/UML kernels, with every series it requires
        queue = kernel.QUEUES[args.queue or kernel.queue_for("x86_64").name]
    if args.action == "tree":
        kernel.materialise(shell, queue, tree)
        return tree_ready(tree, kernel.stack(queue))
    if args.action == "export":
        return exported(kernel.export_stack(shell, tree, queue), kernel.QUEUES)
    if args.action == "build-each":
        arches = tuple(a for a in args.arch.split(",") if a)
        return report([prefixbuild.build_each(shell, queue, arches, not args.no_kunit,
                                              args.start)])
    # each series applies to pristine 6.12 after the series it requires; so
    # does the platform support of each arch
    queues = [kernel.QUEUES[args.queue]] if args.queue else [*kernel.QUEUES.values(),
                                                             *kernel.PLATFORM_QUEUES.values()]
    return report([kernel.check(shell, q) for q in queues])


def cmd_qemu(args: argparse.Namespace, shell: Shell) -> int:
    """The QEMU patch series (qemu/), the twin of `series` for kernel/."""
    tree = Path(args.dir) if args.dir else paths.QEMU_DIR / "tree"
    if args.action == "build":
        res, _ = qemu.build_stage(shell)
        return report([res])
    if args.action == "tree":
        qemu.materialise(shell, tree)
        return tree_ready(tree, qemu.stack())
    if args.action == "export":
        return exported(qemu.export_stack(shell, tree), qemu.QUEUES)
    if args.action == "qtest":
        return report([qemu.qtest_stage(shell, tuple(args.extra_patch))])
    if args.action == "migration-test":
        return report([qemu.migration_test_stage(shell, tuple(args.extra_patch),
                                                 pristine=args.pristine)])
    # each series applies to pristine QEMU after the series it requires
    return report([qemu.check(shell, q) for q in qemu.QUEUES.values()])


def tree_ready(tree: Path, queues: Sequence[patchqueue.Queue]) -> int:
    tags = ", ".join(q.tag for q in queues)
    print(f"work tree ready: {tree} (base tag {patchqueue.BASE_TAG}; series end at {tags})")
    return 0


def exported(names: dict[str, list[str]], queues: Mapping[str, patchqueue.Queue]) -> int:
    for name, patches in names.items():
        print(f"exported {len(patches)} patches to {queues[name].patch_dir}")
    return 0


def cmd_boot(args: argparse.Namespace, shell: Shell) -> int:
    ctx = RunContext.create(shell, f"boot-{args.platform}", platform=args.platform,
                            accel=args.accel, patched=not args.vanilla, variant=args.variant,
                            extra_fragments=tuple(args.fragment), patched_qemu=args.patched_qemu,
                            qemu_extra_patches=tuple(args.qemu_extra_patch))
    script = Path(args.script).read_text() if args.script else DEFAULT_BOOT_SCRIPT
    if args.icount:
        harness.check_icount(ctx, "boot --icount")
    plan = harness.Plan(script, initrd="boot", mem_mib=args.mem,
                        cmdline=tuple(args.cmdline or ()), timeout_s=args.timeout,
                        icount=args.icount)
    start = time.monotonic()
    with harness.start(ctx, BOOT, f"boot-{args.platform}", plan) as run:
        if run is None:
            return 0
        run.guest.wait_for(BOOTED, args.timeout)
        booted = time.monotonic() - start
        rc = run.wait_exit()
    print(run.guest.tail(60))
    print(f"boot {args.platform}: booted in {booted:.1f} s, script exit {rc}, "
          f"log {run.guest.log_path}")
    harness.check(run.booted)
    return rc


def cmd_run(args: argparse.Namespace, shell: Shell) -> int:
    scenario = scenarios.get(args.scenario)
    params = scenario.params(_parse_params(args.param))
    ctx = RunContext.create(shell, f"{args.scenario}-{args.platform}", platform=args.platform,
                            accel=args.accel, patched=not args.vanilla, variant=args.variant,
                            extra_fragments=tuple(args.fragment), patched_qemu=args.patched_qemu,
                            qemu_extra_patches=tuple(args.qemu_extra_patch))
    outcome = scenarios.run(scenario, ctx, params)
    print(outcome.table)
    uneven = ctx.uneven_kernels()
    if uneven:
        print(f"note: {uneven}")
    for p in outcome.plots:
        print(f"plot: {p}")
    print(f"results: {ctx.run_dir}")
    return 0


def trace_kernels(patches: Sequence[str]) -> list[tuple[str, bool, tuple[str, ...]]]:
    """What `freepage trace` compares: stock, the series, and the series with
    each test-only patch of `patches` (label, patched, extra patches)."""
    return [("stock", False, ()), ("series", True, ()),
            *((f"series+{Path(p).stem}", True, (p,)) for p in patches)]


def cmd_trace(args: argparse.Namespace, shell: Shell) -> int:
    ctx = RunContext.create(shell, "trace-qemu", platform="qemu", accel="tcg",
                            extra_fragments=("bench.config",))
    kernels = trace_kernels(args.patch)
    if args.loop == "fault":
        return trace_fault_loop(ctx, shell, kernels)
    initrd = ctx.initrd("trace", insntrace.GUEST_SCRIPT)
    results: dict[str, insntrace.Iteration] = {}
    for label, patched, extra in kernels:
        image = ctx.kernel(patched=patched, extra_patches=(BENCH_PATCH, *extra))
        build_dir = image.parents[3]
        pcs = insntrace.trace_kernel(shell, build_dir, initrd, ctx.run_dir / label,
                                     steps=args.steps)
        if shell.dry_run:
            continue
        results[label] = insntrace.one_iteration(pcs, insntrace.Symbols.of(build_dir / "vmlinux"))
    if shell.dry_run:
        return 0
    insntrace.save(ctx.run_dir / "trace.json", results)
    print("instructions of one order-0 alloc+free iteration of the benchmark loop")
    print(insntrace.table(results))
    for label, it in results.items():
        print(f"{label}: iterations traced {it.lengths}")
    print(f"results: {ctx.run_dir}")
    return 0


def cmd_mm_selftests(args: argparse.Namespace, shell: Shell) -> int:
    """The kernel's mm selftests, stock vs the series' configurations."""
    ctx = RunContext.create(shell, "mm-selftests-qemu", platform="qemu", accel=args.accel,
                            patched=True, extra_fragments=("mm-selftests.config",))
    tests = mmselftests.select(tuple(args.only), args.quick)
    configs = (tuple(c for c in ",".join(args.configs).split(",") if c)
               or tuple(mmselftests.CONFIGS))
    rc, _, text = mmselftests.run(ctx, args.runs, tests, configs,
                                  tuple(Path(d) for d in args.with_runs), args.smp)
    print(text)
    if not shell.dry_run:
        print(f"results: {ctx.run_dir}")
    return rc


def cmd_compare(args: argparse.Namespace, shell: Shell) -> int:
    del shell
    runs = [Path(r) for r in args.runs]
    loaded = []
    for run in runs:
        files = sorted(run.glob("*.json"))
        if not files:
            raise LabError(f"{run}: no result JSON files")
        tree = {f.stem: json.loads(f.read_text()) for f in files}
        loaded.append(medians(tree))
    if len(loaded) == 1:
        for k, v in sorted(loaded[0].items()):
            print(f"{k:70s} {v:12.3f}")
        return 0
    a, b = loaded
    print(f"{'metric (median)':70s} {'A':>10s} {'B':>10s} {'B/A':>7s}")
    for k in sorted(set(a) & set(b)):
        ratio = f"{b[k] / a[k]:.2f}" if a[k] else "n/a"
        print(f"{k:70s} {a[k]:10.2f} {b[k]:10.2f} {ratio:>7s}")
    return 0


def trace_fault_loop(ctx: RunContext, shell: Shell,
                     kernels: Sequence[tuple[str, bool, tuple[str, ...]]]) -> int:
    """Instructions per page fault of the churn loop, per function, of
    `kernels` (trace_kernels: stock, the series, the series with bench
    patches; benchmark kernels, QEMU TCG with a counting plugin)."""
    plugin = insntrace.build_plugin(shell)
    short, long = insntrace.FAULT_LOOPS
    initrds = {n: ctx.initrd(f"fault-{n}", insntrace.fault_script(n)) for n in (short, long)}
    results: dict[str, dict[str, float]] = {}
    for label, patched, extra in kernels:
        build_dir = ctx.kernel(patched=patched, extra_patches=extra).parents[3]
        counted = {n: insntrace.count_blocks(shell, build_dir, initrds[n], plugin,
                                             ctx.run_dir / f"{label}-{n}")
                   for n in (short, long)}
        if shell.dry_run:
            continue
        syms = insntrace.Symbols.of(build_dir / "vmlinux")
        faults = (insntrace.churn_faults(counted[long][1])
                  - insntrace.churn_faults(counted[short][1]))
        results[label] = insntrace.per_fault(insntrace.per_function(counted[short][0], syms),
                                             insntrace.per_function(counted[long][0], syms),
                                             faults)
    if shell.dry_run:
        return 0
    (ctx.run_dir / "fault-loop.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"instructions per page fault of a {insntrace.FAULT_LOOP_MIB} MiB mmap/write/munmap "
          f"loop ({long} iterations minus {short}), per function")
    print(insntrace.fault_table(results))
    print(f"results: {ctx.run_dir}")
    return 0


def cmd_package(args: argparse.Namespace, shell: Shell) -> int:
    """Debian packages of the guest kernel, the patched QEMU and the daemon."""
    results = packages.package_all(shell, Path(args.out), tuple(args.only))
    rc = report(results)
    if not shell.dry_run and rc == 0:
        print(f"packages: {Path(args.out).resolve()}")
    return rc


def cmd_libvirt_enable(args: argparse.Namespace, shell: Shell) -> int:
    """freepage in an existing libvirt domain (libvirtxml.enable), defined again."""
    virsh = ["virsh", *(["-c", args.connect] if args.connect else [])]
    xml = shell.run([*virsh, "dumpxml", "--inactive", args.domain], capture=True,
                    what=f"virsh dumpxml {args.domain}")
    if shell.dry_run:
        shell.show([*virsh, "define", "<the domain with freepage on>"])
        return 0
    new = libvirtxml.enable(xml, hint=not args.no_hint, device_init=not args.no_device_init)
    if args.print:
        print(new)
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".xml") as f:
        f.write(new)
        f.flush()
        shell.run([*virsh, "define", f.name], what=f"virsh define {args.domain}")
    print(f"{args.domain}: freepage on from its next start")
    return 0


def cmd_host(args: argparse.Namespace, shell: Shell) -> int:
    """What this host offers the guests; 1 with the reasons where one cannot run."""
    host = hostcheck.facts()
    print("\n".join(host.lines()))
    if args.json:
        hostcheck.save(Path(args.json), host)
    problems = host.problems()
    for problem in problems:
        print(f"freepage host: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cmd_demo(args: argparse.Namespace, shell: Shell) -> int:
    """Stock vs freepage, side by side, for every feature that exists."""
    _, failed = demo.run(shell, args.accel, args.quick, tuple(args.only))
    return 1 if failed else 0


def report(results: list[StageResult]) -> int:
    for r in results:
        print(f"[{r.status.upper():7s}] {r.name} ({r.elapsed_s:.1f} s) {r.detail}")
    return 0 if all(r.ok for r in results) else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freepage", description=__doc__)
    p.add_argument("--dry-run", action="store_true", help="print commands, run nothing")
    sub = p.add_subparsers(dest="command", required=True)

    def platform_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--platform", choices=tuple(PLATFORMS), default="qemu",
                        help="arm64: qemu-system-aarch64 with EL2, the guest runs KVM")
        sp.add_argument("--accel", choices=("auto", "tcg", "kvm"), default="auto",
                        help="QEMU accelerator; auto uses KVM only if it is hardware KVM")
        sp.add_argument("--vanilla", action="store_true", help="stock kernel, series not applied")
        sp.add_argument("--variant", choices=kernel.VARIANTS, default="release")
        sp.add_argument("--fragment", action="append", default=[],
                        help="extra config fragment for the patched kernel (repeatable); "
                        "bench.config applies to the stock kernel too")
        sp.add_argument("--patched-qemu", action="store_true",
                        help="QEMU built with the qemu/ series (cached) instead of Debian's")
        sp.add_argument("--qemu-extra-patch", action="append", default=[], metavar="NAME",
                        help="test-only qemu/bench/NAME on top of the patched QEMU, for a "
                        "baseline that takes one change back out (repeatable)")

    b = sub.add_parser("build", help="build guest kernels (cached)")
    b.add_argument("--arch", choices=(*kernel.ARCHES, "all"), default="all")
    b.add_argument("--variant", choices=kernel.VARIANTS, default="release")
    b.add_argument("--vanilla", action="store_true", help="stock kernel: apply none of the kernel series")
    b.add_argument("--fragment", action="append", default=[],
                   help="extra config fragment from kernel/configs (repeatable)")
    b.add_argument("--patch", action="append", default=[],
                   help="test-only patch from the series' bench/ directory, applied after "
                   "the series (repeatable), e.g. split-walk-stats.patch for arm64")
    b.set_defaults(func=cmd_build)

    s = sub.add_parser("series", help="kernel patch series: work tree, export, check, "
                       "build every patch")
    s.add_argument("action", choices=("tree", "export", "check", "build-each"))
    s.add_argument("dir", nargs="?", default=None,
                   help="git work tree (tree: created; export: read); "
                   "default kernel/tree (qemu/tree with --qemu)")
    s.add_argument("--qemu", action="store_true", help="the QEMU series (qemu/) instead")
    s.add_argument("--queue", choices=sorted(kernel.QUEUES),
                   help="which kernel series, with the series it requires (default: prezero, "
                   "i.e. all three x86/UML series; check: every series)")
    s.add_argument("--arch", default=",".join(prefixbuild.ARCHES),
                   help="build-each: comma-separated arches to build at every patch")
    s.add_argument("--no-kunit", action="store_true",
                   help="build-each: do not run the UML KUnit suites where a patch changes them")
    s.add_argument("--from", dest="start", metavar="PATCH",
                   help="build-each: begin building at this patch (its number in the stack, or "
                   "a unique part of its name such as prezero/0004); the ones before are "
                   "applied unbuilt")
    s.set_defaults(func=cmd_series)

    q = sub.add_parser("qemu", help="QEMU patch series (qemu/): build, work tree, export, check")
    q.add_argument("action", choices=("build", "tree", "export", "check", "qtest",
                                      "migration-test"))
    q.add_argument("dir", nargs="?", default=None,
                   help="git work tree (tree: created; export: read); default qemu/tree")
    q.add_argument("--extra-patch", action="append", default=[], metavar="NAME",
                   help="qtest, migration-test: also apply the test-only qemu/bench/NAME "
                        "to the patched build (e.g. one that "
                        "takes a fix back out)")
    q.add_argument("--pristine", action="store_true",
                   help="migration-test: also run every chosen case on pristine QEMU "
                        "(else only those the patched build does not pass)")
    q.set_defaults(func=cmd_qemu)

    bt = sub.add_parser("boot", help="boot a guest and run a script")
    platform_opts(bt)
    bt.add_argument("--script", help="shell script to run in the guest")
    bt.add_argument("--mem", type=int, default=512, help="guest RAM in MiB")
    bt.add_argument("--timeout", type=float, default=120)
    bt.add_argument("--cmdline", action="append", help="extra kernel command line word")
    bt.add_argument("--icount", action="store_true",
                    help="QEMU TCG -icount shift=0: guest time counts instructions, so "
                    "durations the guest measures are instruction counts")
    bt.set_defaults(func=cmd_boot)

    r = sub.add_parser("run", help="run one scenario")
    r.add_argument("scenario", choices=sorted(scenarios.registry()))
    platform_opts(r)
    r.add_argument("--param", action="append", default=[], help="key=value scenario parameter")
    r.set_defaults(func=cmd_run)

    m = sub.add_parser("mm-selftests", help="the kernel's mm selftests in a stock guest and "
                       "the series (pre-zeroing, reporting, init_on_free=1); exit 1 on a "
                       "test that passes on stock and not on the series")
    m.add_argument("--runs", type=int, default=1, help="boots of each configuration")
    m.add_argument("--quick", action="store_true",
                   help="the hugetlb tests and a few quick ones (mmselftests.QUICK)")
    m.add_argument("--only", action="append", default=[], metavar="TEST",
                   help="run only this test or program (repeatable)")
    m.add_argument("--configs", action="append", default=[],
                   help="comma-separated configurations (default: "
                   f"{','.join(mmselftests.CONFIGS)})")
    m.add_argument("--with", dest="with_runs", action="append", default=[],
                   metavar="RUN_DIR", help="add the boots of an earlier run of the same "
                   "tests to the table and the gate (repeatable)")
    m.add_argument("--smp", type=int, default=1,
                   help="vCPUs of every guest (races such as hugetlb_fault_after_madv's "
                   "need more than one)")
    m.add_argument("--accel", choices=("auto", "tcg", "kvm"), default="auto")
    m.set_defaults(func=cmd_mm_selftests)

    c = sub.add_parser("compare", help="print medians of one run, or A/B of two runs")
    c.add_argument("runs", nargs="+", help="run directories (one or two)")
    c.set_defaults(func=cmd_compare)

    t = sub.add_parser("trace", help="instructions of the allocator fast path or of a page "
                       "fault, per function, stock against the series (x86_64 benchmark "
                       "kernels, QEMU TCG)")
    t.add_argument("--loop", choices=("fastpath", "fault"), default="fastpath",
                   help="fastpath: one order-0 alloc+free of the benchmark loop, single-"
                   "stepped with gdb; fault: a 512 MiB mmap/write/munmap loop, counted by "
                   "a QEMU plugin, per page fault")
    t.add_argument("--patch", action="append", default=[], metavar="NAME",
                   help="also trace the series with the test-only kernel/bench/NAME "
                   "(repeatable), e.g. pcp-drop.patch")
    t.add_argument("--steps", type=int, default=3000,
                   help="fastpath: instructions to single-step (several iterations must fit)")
    t.set_defaults(func=cmd_trace)
    pk = sub.add_parser("package", help="Debian packages of the guest kernel "
                        "(linux-image-*-freepage), the patched QEMU "
                        f"({packages.QEMU_PACKAGE}) and {packages.DAEMON_PACKAGE}, from the "
                        "cached builds, lintian-checked")
    pk.add_argument("--out", default=str(paths.REPO / "packages"),
                    help="directory the .debs are copied into (default: packages/)")
    pk.add_argument("--only", action="append", default=[], choices=packages.WHAT,
                    help="build only this package (repeatable)")
    pk.set_defaults(func=cmd_package)
    lv = sub.add_parser("libvirt-enable", help="turn freepage on in an existing libvirt "
                        "domain (docs/operators.md): the packaged QEMU, reporting, hinting, "
                        "bits 6/7, the guest's opt-in; takes effect at its next start")
    lv.add_argument("domain")
    lv.add_argument("--connect", metavar="URI", help="libvirt URI (virsh -c)")
    lv.add_argument("--no-hint", action="store_true", help="leave free page hinting off")
    lv.add_argument("--no-device-init", action="store_true",
                    help="leave the experimental bits 6/7 (x-device-init-*) off")
    lv.add_argument("--print", action="store_true",
                    help="print the new domain XML instead of defining it")
    lv.set_defaults(func=cmd_libvirt_enable)
    h = sub.add_parser("host", help="what this host offers the guests (CPU and its XSAVE "
                       "area, ptrace, UML's memory file, KVM, QEMU); exit 1 where a guest "
                       "cannot run, with the reason")
    h.add_argument("--json", metavar="FILE", help="also write the findings as JSON")
    h.set_defaults(func=cmd_host)

    d = sub.add_parser("demo", help="stock vs freepage, side by side, for every feature")
    d.add_argument("--accel", choices=("auto", "tcg", "kvm"), default="auto")
    d.add_argument("--quick", action="store_true",
                   help="fewer repetitions (about 15 minutes on a warm cache)")
    d.add_argument("--only", action="append", default=[],
                   help="run only this scenario's steps (repeatable)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    shell = Shell(dry_run=args.dry_run)
    try:
        return int(args.func(args, shell))
    except LabError as exc:
        print(f"freepage: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("freepage: interrupted", file=sys.stderr)
        return 130
    finally:
        guest_mod.kill_all()


if __name__ == "__main__":
    sys.exit(main())

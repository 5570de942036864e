"""The kernel's own mm selftests as a gate: stock 6.12 against the series.

    freepage mm-selftests [--runs 3] [--quick | --only NAME ...]

boots, `runs` rounds in ABBA order, a stock 6.12 guest and the series in
three configurations (`CONFIGS`): pre-zeroing on, the plain series (free
page reporting on), and the series with init_on_free=1. Every guest is the
same QEMU x86_64 guest (Debian's QEMU, TCG, one vCPU unless --smp, 3 GiB, a
virtio-balloon with free-page-reporting=on), its kernel built with
kernel/configs/mm-selftests.config, its initramfs carrying the mm selftests
(selftests.MM, built statically from pristine 6.12) under /mm and a small
runner: run_vmtests.sh needs bash, sudo and modules the guest does not
have, so `TESTS` is its list, in its order, with the setup it does around
each test (hugetlb pool, shmmax, overcommit), minus `LEFT_OUT`, each with
its reason.

A test passes (exit 0), skips (exit 4, kselftest's KSFT_SKIP), fails, or
times out (its `limit_s`, busybox timeout); a guest that crashes leaves
its remaining tests "lost". The table shows, per test and configuration,
the passes out of the runs; the gate fails (exit 1) when a test that
passed in every stock run did anything else in any run of the series.
`--with RUN_DIR` adds the boots of an earlier run of the same tests (say,
stock runs made while the series was still building) to the table and the
gate.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import guestshell, harness
from .context import RunContext
from .scenarios import table
from .selftests import MM
from .shell import LabError

KSFT_SKIP = 4
# what busybox timeout leaves: SIGTERM (143); KILL or an OOM kill: 137
TIMEOUT_CODES = (124, 137, 143)
PROG = "mm-selftest"
# the run directory's result file (<RESULT>.json)
RESULT = "mm-selftests"
BEGIN = "MM-SELFTEST-BEGIN"
STATUSES = ("pass", "skip", "fail", "timeout", "lost")
# the line after the last test: pages pre-zeroed in the zones and the hugetlb pool
VMSTAT = "MM-SELFTEST-VMSTAT"
VMSTAT_COUNTERS = ("pgzero_marked_prezero", "pgzero_prezero_hugetlb")
# run_vmtests.sh's pool: 256 MiB of 2 MiB pages (and 2 * nr_cpus pages for uffd)
HUGETLB_POOL_PAGES = 128
MEM_MIB = 3072


@dataclass(frozen=True)
class Test:
    """One run of one selftest, as run_vmtests.sh runs it."""

    # the table's row: the program and its arguments, shell words
    name: str
    # run_vmtests.sh's category (hugetlb and thp drop caches and compact first)
    category: str
    # shell lines before and after (setup and its undoing)
    before: str = ""
    after: str = ""
    # busybox timeout for the test under TCG (run_vmtests.sh's settings: 180 s natively)
    limit_s: int = 300

    @property
    def program(self) -> str:
        return self.name.split()[0]


def _sysctl(path: str, value: str, var: str) -> tuple[str, str]:
    """Set a /proc/sys file for one test, and put it back after."""
    return (f"{var}=$(cat {path}); echo {value} > {path}", f'echo "${var}" > {path}')


_SHM = [_sysctl("/proc/sys/kernel/shmmax", "268435456", "old_shmmax"),
        _sysctl("/proc/sys/kernel/shmall", "4194304", "old_shmall")]
_ONE_PAGE = _sysctl("/proc/sys/vm/nr_hugepages", "1", "old_pool")
_OVERCOMMIT = _sysctl("/proc/sys/vm/overcommit_memory", "1", "old_overcommit")
# uffd-stress: half the free pool for each of source and destination, in
# MiB: with 2 MiB pages, as many MiB as there are free pages
_HALF_POOL = "half=$(awk '/^HugePages_Free:/{print $2}' /proc/meminfo)"

TESTS: tuple[Test, ...] = (
    Test("hugepage-mmap", "hugetlb"),
    Test("hugepage-shm", "hugetlb", "; ".join(b for b, _ in _SHM),
         "; ".join(a for _, a in _SHM)),
    Test("map_hugetlb", "hugetlb"),
    Test("hugepage-mremap", "hugetlb"),
    Test("hugepage-vmemmap", "hugetlb"),
    Test("hugetlb-madvise", "hugetlb"),
    Test("hugetlb_dio", "hugetlb"),
    # "we need one and just one huge page"; 10000 rounds of two threads
    # each: 165 s under TCG on a busy host
    Test("hugetlb_fault_after_madv", "hugetlb", *_ONE_PAGE, limit_s=900),
    Test("hugetlb_madv_vs_map", "hugetlb", *_ONE_PAGE),
    Test("map_fixed_noreplace", "mmap"),
    Test("gup_test -u", "gup_test"),
    Test("gup_test -a", "gup_test"),
    Test("gup_test -ct -F 0x1 0 19 0x1000", "gup_test"),
    Test("gup_longterm", "gup_test", limit_s=600),
    Test("uffd-unit-tests", "userfaultfd", limit_s=600),
    Test("uffd-stress anon 20 16", "userfaultfd", limit_s=600),
    Test("uffd-stress hugetlb $half 32", "userfaultfd", _HALF_POOL, limit_s=600),
    Test("uffd-stress hugetlb-private $half 32", "userfaultfd", _HALF_POOL, limit_s=600),
    Test("uffd-stress shmem 20 16", "userfaultfd", limit_s=600),
    Test("uffd-stress shmem-private 20 16", "userfaultfd", limit_s=600),
    Test("compaction_test", "compaction", limit_s=600),
    Test("map_populate", "mmap"),
    Test("mlock-random-test", "mlock"),
    Test("mlock2-tests", "mlock"),
    Test("mrelease_test", "process_mrelease"),
    Test("mremap_test", "mremap", limit_s=600),
    Test("thuge-gen", "hugetlb"),
    Test("virtual_address_range", "hugevm", *_OVERCOMMIT),
    Test("mremap_dontunmap", "mremap"),
    Test("madv_populate", "madv_populate"),
    Test("memfd_secret", "memfd_secret"),
    Test("ksm_tests -H -s 100", "ksm", limit_s=600),
    Test("ksm_tests -P -s 100", "ksm", limit_s=600),
    Test("ksm_tests -M -p 10", "ksm"),
    Test("ksm_tests -U", "ksm"),
    Test("ksm_tests -Z -p 10 -z 0", "ksm"),
    Test("ksm_tests -Z -p 10 -z 1", "ksm"),
    Test("ksm_functional_tests", "ksm"),
    Test("soft-dirty", "soft_dirty"),
    Test("pagemap_ioctl", "pagemap", limit_s=600),
    Test("cow", "cow", limit_s=900),
    Test("transhuge-stress -d 20", "thp"),
    Test("split_huge_page_test", "thp", limit_s=600),
    Test("mkdirty", "mkdirty"),
    Test("mdwe_test", "mdwe"),
    # built by the mm Makefile, not run by run_vmtests.sh in 6.12
    Test("mseal_test", "mseal"),
    Test("seal_elf", "mseal"),
    Test("droppable", "droppable"),
)

# what run_vmtests.sh runs (or the Makefile builds) that this gate does not
LEFT_OUT = {
    "khugepaged": "does not build in 6.12 (khugepaged.c: KSFT_SKIP undeclared)",
    "on-fault-limit": "needs an unprivileged user (sudo -u nobody); the guest has only root",
    "migration": "needs two NUMA nodes",
    "ksm_tests -N": "needs two NUMA nodes",
    "hmm-tests (test_hmm.sh)": "needs the test_hmm module (the guest kernel has no modules)",
    "test_vmalloc.sh": "needs the test_vmalloc module",
    "charge_reserved_hugetlb.sh, hugetlb_reparenting_test.sh":
        "bash scripts on the cgroup v2 hugetlb controller (no bash, no cgroups in the guest)",
    "va_high_addr_switch.sh": "bash script; needs 5-level paging to test anything",
    "protection_keys, pkey_sighandler_tests": "x86 protection keys, not memory the series manages",
    "hugetlb-soft-offline, hugetlb-read-hwpoison": "destructive (run_vmtests.sh -d)",
    "gup_test matrix": "run_vmtests.sh -a only (the default gup_test runs are here)",
}

# hugetlb tests, the one known to fail with pre-zeroing, and a few quick ones
QUICK = ("hugepage-mmap", "hugepage-shm", "map_hugetlb", "hugepage-mremap", "hugepage-vmemmap",
         "hugetlb-madvise", "hugetlb_dio", "hugetlb_fault_after_madv", "hugetlb_madv_vs_map",
         "cow", "gup_longterm", "ksm_functional_tests", "uffd-unit-tests", "compaction_test",
         "mseal_test")


@dataclass(frozen=True)
class Config:
    """A column of the table: a kernel, and what its guest sets first."""

    name: str
    variant: harness.Variant
    setup: str = ""
    cmdline: tuple[str, ...] = ()


def _prezero_on() -> str:
    d = guestshell.PREZERO_DIR
    return "\n".join([guestshell.require_prezero("mm-selftests"),
                      f"echo 1 > {d}/enabled", f"echo 100 > {d}/cpu_percent",
                      f"echo 1 > {d}/hugetlb"])


_FAMILY = harness.family("mm_selftests")
CONFIGS = {c.name: c for c in (
    Config("stock", _FAMILY["stock"]),
    Config("prezero", _FAMILY["series"], setup=_prezero_on()),
    Config("reporting", _FAMILY["series"]),
    Config("init_on_free", _FAMILY["series"], cmdline=("init_on_free=1",)),
)}


def select(only: Sequence[str] = (), quick: bool = False) -> list[Test]:
    """The tests to run, in TESTS order: `only` names (a program runs all
    its rows), else QUICK or all."""
    names = tuple(only) or (QUICK if quick else ())
    if not names:
        return list(TESTS)
    known = {t.name for t in TESTS} | {t.program for t in TESTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        left = [n for n in unknown if any(n in k for k in LEFT_OUT)]
        why = "; ".join(f"{k}: {v}" for k, v in LEFT_OUT.items() if any(n in k for n in left))
        raise LabError(f"mm-selftests: unknown tests {unknown}" + (f" (left out: {why})"
                                                                  if why else ""))
    return [t for t in TESTS if t.name in names or t.program in names]


def guest_script(tests: Sequence[Test], setup: str = "") -> str:
    """The runner: the hugetlb pool, the config's setup, then each test in
    /mm under busybox timeout, a JSON line after each (the guest's init
    mounts debugfs)."""
    lines = [
        f"echo {HUGETLB_POOL_PAGES} > /proc/sys/vm/nr_hugepages",
        "free_pages=$(awk '/^HugePages_Free:/{print $2}' /proc/meminfo)",
        f'echo "hugetlb pool: $free_pages of {HUGETLB_POOL_PAGES} pages"',
        setup,
        "cd /mm",
        "run() {",
        "\tname=$1; limit=$2; shift 2",
        f'\techo "{BEGIN} $name"',
        "\tt0=$(cut -d' ' -f1 /proc/uptime); rc=0",
        "\ttimeout \"$limit\" \"$@\" </dev/null 2>&1 || rc=$?",
        "\tt1=$(cut -d' ' -f1 /proc/uptime)",
        f"\tprintf '{{\"prog\":\"{PROG}\",\"test\":\"%s\",\"rc\":%d,\"elapsed_s\":%s,"
        "\"limit_s\":%d}\\n' \"$name\" \"$rc\" \"$(echo \"$t0 $t1\" | awk '{print $2 - $1}')\" "
        "\"$limit\"",
        "}",
    ]
    if setup:
        lines.append(f"grep . {guestshell.PREZERO_DIR}/* 2>/dev/null || true")
    for t in tests:
        if t.category in ("hugetlb", "thp"):
            # run_vmtests.sh's pauses are idle time, in which pre-zeroing runs
            lines.append("echo 3 > /proc/sys/vm/drop_caches; sleep 2; "
                         "echo 1 > /proc/sys/vm/compact_memory; sleep 2")
        if t.before:
            lines.append(t.before)
        lines.append(f"run '{t.name}' {t.limit_s} ./{t.name}")
        if t.after:
            lines.append(t.after)
    # what pre-zeroing did meanwhile (the series' counters; none on stock)
    lines.append(f"echo \"{VMSTAT} $({guestshell.VMSTAT_ALL} | "
                 f"grep -E '^({'|'.join(VMSTAT_COUNTERS)}) ' | tr '\\n' ' ')\"")
    return "\n".join(line for line in lines if line) + "\n"


def status(rec: dict[str, Any]) -> str:
    rc = int(rec["rc"])
    if rc == 0:
        return "pass"
    if rc == KSFT_SKIP:
        return "skip"
    if rc in TIMEOUT_CODES and float(rec.get("elapsed_s", 0)) >= float(rec["limit_s"]) - 1:
        return "timeout"
    return "fail"


def outputs(lines: Sequence[str], keep: int = 15) -> dict[str, list[str]]:
    """Each test's last console lines (between its BEGIN line and its record)."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for text in lines:
        if text.startswith(BEGIN + " "):
            current = text[len(BEGIN) + 1:].strip()
            out[current] = []
        elif text.startswith(f'{{"prog":"{PROG}"'):
            current = None
        elif current is not None:
            out[current] = (out[current] + [text])[-keep:]
    return out


@dataclass
class Boot:
    """One guest: its configuration, round, each test's status, how long."""

    config: str
    round: int
    # the run directory it booted in: an earlier run's boots appear once
    # however many later runs carry them
    run: str = ""
    statuses: dict[str, str] = field(default_factory=dict)
    elapsed_s: dict[str, float] = field(default_factory=dict)
    tails: dict[str, list[str]] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str = ""
    warnings: list[str] = field(default_factory=list)
    vmstat: dict[str, int] = field(default_factory=dict)


def parse_boot(config: str, rnd: int, tests: Sequence[Test], lines: Sequence[str],
               records: Sequence[dict[str, Any]], error: str = "") -> Boot:
    """The statuses of one boot; a test without a record is "lost" (the guest
    crashed or timed out before it ended)."""
    boot = Boot(config, rnd, error=error, warnings=harness.kernel_warnings(lines))
    tails = outputs(lines)
    for rec in records:
        boot.statuses[rec["test"]] = status(rec)
        boot.elapsed_s[rec["test"]] = float(rec["elapsed_s"])
    for text in lines:
        if text.startswith(VMSTAT):
            words = text.split()[1:]
            boot.vmstat = {k: int(v) for k, v in zip(words[::2], words[1::2])}
    for t in tests:
        boot.statuses.setdefault(t.name, "lost")
        if boot.statuses[t.name] != "pass" and t.name in tails:
            boot.tails[t.name] = tails[t.name]
    return boot


def counts(boots: Sequence[Boot], config: str, test: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in boots:
        if b.config == config:
            s = b.statuses.get(test, "lost")
            out[s] = out.get(s, 0) + 1
    return out


def cell(c: dict[str, int]) -> str:
    """"3/3", "1/3 (fail 2)", "skip 3"."""
    runs = sum(c.values())
    if not runs:
        return "-"
    if c.get("skip") == runs:
        return f"skip {runs}"
    others = ", ".join(f"{s} {c[s]}" for s in STATUSES[1:] if c.get(s))
    return f"{c.get('pass', 0)}/{runs}" + (f" ({others})" if others else "")


def regressions(boots: Sequence[Boot], tests: Sequence[Test],
                configs: Sequence[str]) -> list[tuple[str, str, dict[str, int]]]:
    """(test, config, counts) where the test passed in every stock run and
    did anything else in some run of a series configuration."""
    out = []
    for t in tests:
        stock = counts(boots, "stock", t.name)
        if not stock or stock.get("pass", 0) != sum(stock.values()):
            continue
        for name in configs:
            if name == "stock":
                continue
            c = counts(boots, name, t.name)
            if c and c.get("pass", 0) != sum(c.values()):
                out.append((t.name, name, c))
    return out


def render(boots: Sequence[Boot], tests: Sequence[Test], configs: Sequence[str]) -> str:
    rows = [[t.name, *(cell(counts(boots, c, t.name)) for c in configs)] for t in tests]
    rows.append(["(kernel warnings after boot)",
                 *(str(sum(len(b.warnings) for b in boots if b.config == c)) for c in configs)])
    for counter in VMSTAT_COUNTERS:
        rows.append([f"({counter})", *("+".join(str(b.vmstat.get(counter, "-")) for b in boots
                                                if b.config == c) for c in configs)])
    rows.append(["(guest wall time, s)",
                 *("+".join(f"{b.wall_s:.0f}" for b in boots if b.config == c) for c in configs)])
    return table(["test", *configs], rows)


def boot_one(ctx: RunContext, config: Config, rnd: int, tests: Sequence[Test],
             smp: int = 1) -> Boot | None:
    """Boot one guest; a crash or a timeout is a result (the tests it did
    not finish are lost), not an error of the run."""
    plan = harness.Plan(guest_script(tests, config.setup), initrd=f"mm-{config.name}",
                        mem_mib=MEM_MIB, cmdline=config.cmdline, smp=smp,
                        timeout_s=sum(t.limit_s for t in tests) + 600,
                        selftests=(MM.name,))
    name = f"mm-{config.name}-{rnd}"
    start = time.monotonic()
    error = ""
    with harness.start(ctx, config.variant, name, plan) as run:
        if run is None:
            return None
        try:
            rc = run.wait_exit()
            if rc != 0:
                error = f"guest script exit {rc}"
        except LabError as exc:
            error = str(exc).splitlines()[0]
        lines = list(run.booted.lines)
        records = run.booted.records(PROG)
    boot = parse_boot(config.name, rnd, tests, lines, records, error)
    boot.run = ctx.run_dir.name
    boot.wall_s = time.monotonic() - start
    return boot


def load_boots(run_dir: Path, tests: Sequence[Test], smp: int = 1) -> list[Boot]:
    """The boots of an earlier run of the same tests in guests of as many
    vCPUs (its mm-selftests.json)."""
    path = run_dir / f"{RESULT}.json"
    if not path.is_file():
        raise LabError(f"mm-selftests: {path} does not exist")
    data = json.loads(path.read_text())
    if data["tests"] != [t.name for t in tests]:
        raise LabError(f"mm-selftests: {run_dir} ran other tests; give the same --quick/--only")
    # runs from before the option booted one vCPU
    if data.get("smp", 1) != smp:
        raise LabError(f"mm-selftests: {run_dir} booted guests of {data.get('smp', 1)} "
                       f"vCPUs, not {smp}; give the same --smp")
    return [Boot(**{"run": run_dir.name, **b}) for b in data["boots"]]


def merge(boots: Sequence[Boot]) -> list[Boot]:
    """Each boot once (a run given --with carries the boots of its own --with)."""
    seen: dict[tuple[str, str, int], Boot] = {}
    for b in boots:
        seen.setdefault((b.run, b.config, b.round), b)
    return list(seen.values())


def summary(boots: Sequence[Boot], tests: Sequence[Test], configs: Sequence[str],
            **more: Any) -> tuple[int, dict[str, Any], str]:
    """Exit code, JSON and table of the boots so far."""
    configs = [c for c in CONFIGS if c in configs or any(b.config == c for b in boots)]
    bad = regressions(boots, tests, configs)
    data = {**more, "configs": configs, "tests": [t.name for t in tests], "left_out": LEFT_OUT,
            "boots": [asdict(b) for b in boots],
            "regressions": [{"test": t, "config": c, "counts": n} for t, c, n in bad]}
    vcpus = more.get("smp", 1)
    lines = [f"mm selftests (6.12, {len(tests)} tests), passes out of the runs; "
             f"QEMU x86_64 TCG, {vcpus} vCPU{'s' if vcpus > 1 else ''}, {MEM_MIB} MiB, "
             "virtio-balloon free-page-reporting=on",
             render(boots, tests, configs)]
    for b in boots:
        if b.error:
            lines.append(f"{b.config} round {b.round + 1}: {b.error}")
    for test, where, n in bad:
        lines.append(f"REGRESSION {test}: passes on stock every run, {where}: {cell(n)}")
        tail = next((b.tails[test] for b in boots if b.config == where and test in b.tails), [])
        lines += [f"    {ln}" for ln in tail[-4:]]
    lines.append("gate: " + ("FAILED" if bad else "passed"))
    return (1 if bad else 0), data, "\n".join(lines)


def run(ctx: RunContext, runs: int, tests: Sequence[Test], configs: Sequence[str],
        earlier: Sequence[Path] = (), smp: int = 1) -> tuple[int, dict[str, Any], str]:
    """Every configuration `runs` times (ABBA), with the boots of `earlier`
    runs of the same tests; exit code, JSON, table. The JSON is written
    after every boot, so that an interrupted run can join a later one."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise LabError(f"mm-selftests: unknown configurations {unknown or list(configs)}; "
                       f"choose from {', '.join(CONFIGS)}")
    if runs < (0 if earlier else 1):
        raise LabError("mm-selftests: --runs must be at least 1 (0 with --with: a table of "
                       "earlier runs only)")
    if smp < 1:
        raise LabError("mm-selftests: --smp must be at least 1")
    chosen = [CONFIGS[c] for c in configs]
    boots = merge([b for d in earlier for b in load_boots(d, tests, smp)])
    start = time.monotonic()
    kernels = {c.name: str(harness.kernel(ctx, c.variant)) for c in chosen} if runs else {}
    more: dict[str, Any] = {"runs": runs, "earlier": [str(d) for d in earlier],
                            "kernels": kernels, "smp": smp}
    for rnd in range(runs):
        for c in harness.order(chosen, rnd):
            if not ctx.shell.dry_run:
                print(f"mm-selftests: round {rnd + 1}/{runs}, {c.name}", flush=True)
            boot = boot_one(ctx, c, rnd, tests, smp)
            if boot is None:
                continue
            boots.append(boot)
            done = sum(s == "pass" for s in boot.statuses.values())
            print(f"mm-selftests: {c.name} round {rnd + 1}: {done}/{len(tests)} passed in "
                  f"{boot.wall_s:.0f} s" + (f" ({boot.error})" if boot.error else ""),
                  flush=True)
            ctx.save(RESULT, summary(boots, tests, configs, **more,
                                     wall_s=round(time.monotonic() - start, 1))[1])
    if ctx.shell.dry_run:
        return 0, {}, "mm-selftests: dry run, nothing run"
    wall = time.monotonic() - start
    rc, data, text = summary(boots, tests, configs, **more, wall_s=round(wall, 1))
    ctx.save(RESULT, data)
    return rc, data, text + f"\nwall time {wall:.0f} s"

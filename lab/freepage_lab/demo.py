"""`freepage demo`: stock vs freepage, side by side, for every feature.

stock    = Linux 6.12 as Debian ships it + Debian's QEMU 10.0 (or UML with
           vhost-user-balloon offering no zeroing bits)
freepage = the kernel series + QEMU with the qemu/ series (or
           vhost-user-balloon offering bits 6 and 7)

Two kinds of steps:
- "ab": the scenario runs once per side and the medians of both land in
  one table (metric, stock, freepage, freepage/stock);
- "own": the scenario compares its own variants in one run (stock among
  them), which is the stronger A/B; its table is printed as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import scenarios
from .context import RunContext
from .scenarios import Outcome, table
from .shell import LabError, Shell


@dataclass(frozen=True)
class Step:
    title: str
    scenario: str
    platform: str
    kind: str  # "ab" or "own"
    params: dict[str, str]
    quick: dict[str, str]
    # config fragments of its kernels (FRAGMENTS unless the scenario brings its own)
    fragments: tuple[str, ...] | None = None


STEPS = (
    Step("free page reporting: how fast freed memory goes back to the host "
         "(default per-cpu lists; Debian's QEMU for every kernel)",
         "reclaim", "qemu", "own", {},
         {"variants": "stock,freepage", "repeat": "1", "modes": "4k,thp"}),
    Step("populate after reporting: the double zeroing",
         "realloc", "qemu", "ab", {}, {"repeat": "1", "rounds": "1"}),
    Step("live migration with and without free page hinting: stock 6.12 on Debian's QEMU, "
         "the series on the patched QEMU (precopy; idle, dirtying, reusing freed memory)",
         "migrate", "qemu", "own", {},
         {"rounds": "1", "workloads": "idle,reuse", "workload_s": "15"}),
    Step("live migration of an idle 8 GiB guest that used 4 GiB and freed it, legacy "
         "(no hint) vs hinting, the source document's shape (2970 -> 620 ms, -79%)",
         "migrate", "qemu", "own",
         {"mem_mib": "8192", "fill_mib": "4096", "workloads": "idle",
          "variants": "stock,stock-hint,hint", "downtime_limit_ms": "400"},
         {"mem_mib": "8192", "fill_mib": "4096", "workloads": "idle", "rounds": "1",
          "variants": "stock,hint", "downtime_limit_ms": "400"}),
    Step("live migration during a compile in a Debian guest (4 objects of Linux 6.12 mm/, "
         "make -j2, 2 vCPUs, the compile timed in guest instructions), legacy (no hint) vs "
         "hinting, the source document's shape (4502 -> 2273 ms, -50%, compile time unchanged)",
         "migrate", "qemu-debian", "own",
         {"workloads": "compile", "smp": "2", "variants": "stock,stock-hint,no-hint,hint",
          "icount": "true"},
         {"workloads": "compile", "smp": "2", "rounds": "1", "variants": "no-hint,hint",
          "icount": "true"}),
    Step("live migration with free page hinting: postcopy and multifd",
         "migrate", "qemu", "own",
         {"modes": "postcopy,multifd", "workloads": "idle,reuse",
          "variants": "stock,stock-hint,no-hint,hint"},
         {"rounds": "1", "modes": "postcopy,multifd", "workloads": "reuse", "workload_s": "15",
          "variants": "stock-hint,hint"}),
    Step("never zero twice: populate after reporting (stock / series off / series on)",
         "zeroskip", "qemu", "own", {"variants": "vanilla,off,on"},
         {"variants": "vanilla,off,on", "rounds": "1", "repeat": "2", "modes": "4k,thp"}),
    Step("zeroing allocations and the host's footprint (init_on_alloc=1)",
         "zerofirst", "uml", "own", {"pcp_high_fraction": "1000"},
         {"pcp_high_fraction": "1000", "rounds": "1", "iterations": "2"}),
    Step("free page reporting on UML + vhost-user-balloon (default per-cpu lists)",
         "reclaim", "uml", "own", {"modes": "4k", "mem_mib": "1024"},
         {"variants": "stock,freepage", "modes": "4k", "mem_mib": "1024", "repeat": "1"}),
    Step("free page reporting in a Debian guest doing file I/O (a reader through the page "
         "cache, disk and tmpfs writers; Debian 12 root on virtio-blk), stock and the series",
         "reclaim-io", "qemu-debian", "own", {"variants": "stock,freepage"},
         {"variants": "stock,freepage", "repeat": "1", "settle_s": "20"}),
    Step("free page reporting under churn: a 6 x 128 MiB allocate/free loop, reporting off, "
         "stock and the series (UML + vhost-user-balloon; host faults and guest time)",
         "churn", "uml", "own", {"churn_mib": "128", "iterations": "6"},
         {"churn_mib": "128", "iterations": "6", "repeat": "1",
          "variants": "off,stock,freepage"}),
    Step("faster eager split on arm64 KVM: split work, split faults and the ioctls in "
         "emulator instructions, stock and the series step by step (patches 1-3, +4, +5, +6), "
         "the source document's hardware figures beside patches 1-3",
         "split", "arm64", "own",
         {"mib": "1024", "rounds": "1", "variants": "stock,p1-3,p1-4,p1-5,series",
          "backings": "anonymous,anonymous_thp,anonymous_hugetlb_1gb"},
         {"mib": "64", "rounds": "1", "variants": "stock,p1-3,p1-4,p1-5,series"},
         # the scenario's own -O2 fragment (arm64-split-bench.config): the kernels of
         # `freepage run split`, no second set with bench.config's CMA and schedstats
         fragments=()),
    Step("pre-zeroing: 4 KiB populate and in-kernel __GFP_ZERO, stock vs pre-zeroed (UML)",
         "prezero", "uml", "own",
         {"variants": "vanilla,on", "modes": "4k,kzero9", "mem_mib": "1280",
          "pcp_high_fraction": "1000"},
         {"variants": "vanilla,on", "modes": "4k,kzero9", "repeat": "1", "mem_mib": "1024",
          "populate_mib": "256", "pcp_high_fraction": "1000"}),
    Step("pre-zeroing: THP and hugetlb populate, stock vs pre-zeroed (QEMU, guest instructions)",
         "prezero", "qemu", "own",
         {"variants": "vanilla,on", "modes": "thp,hugetlb", "populate_mib": "512",
          "repeat": "3"},
         {"variants": "vanilla,on", "modes": "thp,hugetlb", "repeat": "1", "mem_mib": "1024",
          "populate_mib": "128"}),
    Step("pre-zeroing: VM creation on a host running the series (Debian's QEMU in a Debian "
         "guest starts a VM with preallocated memory; 4 KiB, THP; guest instructions), stock, "
         "the series off and on, the source document's row (64 GiB: 4 KiB 2.3x, THP 9.4x)",
         "vmcreate", "qemu-debian", "own", {},
         {"repeat": "1", "mem_mib": "1024", "vm_mib": "512", "modes": "4k,thp"}),
    # the 32 and 128 GiB migrations are `freepage run migrate --param mem_mib=...`
    # (docs/results/free-page-hint.md): too long for a demo under TCG
    Step("free page reporting and pre-zeroing: cost per GiB by guest size (1, 8, 32 GiB; "
         "--quick: 1 GiB only)",
         "scale", "qemu", "own", {}, {"sizes_gib": "1", "repeat": "1"}),
)


def medians(data: object, prefix: str = "") -> dict[str, float]:
    """Every number at or under a 'median' key of a result tree, keyed by its path."""
    out: dict[str, float] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (
                    "median" in path.split(".")):
                out[path] = float(v)
            else:
                out.update(medians(v, path))
    return out


def side_by_side(stock: dict[str, Any], freepage: dict[str, Any]) -> str:
    """Medians of two result trees of the same scenario, row by row."""
    a, b = medians(stock), medians(freepage)
    rows = []
    for key in sorted(set(a) & set(b)):
        ratio = f"{b[key] / a[key]:.2f}x" if a[key] else "n/a"
        rows.append([key.removesuffix(".median"), f"{a[key]:.2f}", f"{b[key]:.2f}", ratio])
    if not rows:
        return "(no common medians)"
    return table(["metric (median)", "stock", "freepage", "freepage/stock"], rows)


# Numbers, not tests: both sides -O2, without the series' debug check (which
# reads every page it skips clearing, and costs more than the clearing).
FRAGMENTS = ("bench.config",)


def contexts(shell: Shell, accel: str) -> tuple[RunContext, RunContext]:
    stock = RunContext.create(shell, "demo", accel=accel, extra_fragments=FRAGMENTS)
    # its own builds: the dry run prints each side's kernels
    freepage = RunContext(shell=shell, run_dir=stock.run_dir, accel=accel, patched=True,
                          patched_qemu=True, extra_fragments=FRAGMENTS)
    return stock, freepage


def run_step(step: Step, stock: RunContext, freepage: RunContext, quick: bool) -> str:
    scenario = scenarios.get(step.scenario)
    params = scenario.params(step.quick if quick else step.params)
    kw = {} if step.fragments is None else {"extra_fragments": step.fragments}
    stock, freepage = stock.on(step.platform, **kw), freepage.on(step.platform, **kw)
    if step.kind == "own":
        outcome: Outcome = scenarios.run(scenario, freepage, params)
        return outcome.table
    a = scenarios.run(scenario, stock, params)
    b = scenarios.run(scenario, freepage, params)
    if stock.shell.dry_run:
        return "(dry run)"
    return side_by_side(a.data, b.data)


@dataclass
class Done:
    """A step as it ended: its table, or why it failed."""

    step: Step
    text: str
    error: str = ""


def run_steps(steps: tuple[Step, ...], stock: RunContext, freepage: RunContext,
              quick: bool) -> list[Done]:
    """Every step in turn; one that fails says why and the next one runs."""
    done = []
    for step in steps:
        head = f"== {step.title} [{step.scenario} on {step.platform}] =="
        print(head, flush=True)
        try:
            text = run_step(step, stock, freepage, quick)
            done.append(Done(step, text))
        except Exception as exc:  # a failed step must not end the demo
            why = str(exc) if isinstance(exc, LabError) else f"{type(exc).__name__}: {exc}"
            text = f"step failed: {why}"
            done.append(Done(step, text, why.splitlines()[0] if why else type(exc).__name__))
        print(text, flush=True)
    return done


def summary(done: list[Done]) -> str:
    """One row per step: ran or failed, and the first line of why."""
    rows = [[f"{d.step.scenario} on {d.step.platform}", "failed" if d.error else "ok",
             d.error[:100]] for d in done]
    failed = sum(1 for d in done if d.error)
    return (table(["step", "result", "why"], rows)
            + f"\n{len(done) - failed} of {len(done)} steps ran, {failed} failed")


def run(shell: Shell, accel: str, quick: bool, only: tuple[str, ...] = ()) -> tuple[Path, int]:
    """The demo's steps; (run directory, steps that failed)."""
    stock, freepage = contexts(shell, accel)
    steps = tuple(s for s in STEPS if not only or s.scenario in only)
    done = run_steps(steps, stock, freepage, quick)
    texts = [f"== {d.step.title} [{d.step.scenario} on {d.step.platform}] ==\n{d.text}"
             for d in done]
    total = summary(done)
    print(f"== summary ==\n{total}", flush=True)
    if not shell.dry_run:
        (stock.run_dir / "summary.txt").write_text("\n\n".join([*texts, total]) + "\n")
    print(f"results: {stock.run_dir}")
    return stock.run_dir, sum(1 for d in done if d.error)

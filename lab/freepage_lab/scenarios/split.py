"""split: the work of KVM arm64's eager stage-2 split, stock vs the arm64-split series.

Platform arm64 only: qemu-system-aarch64 (TCG) gives the guest EL2, so its
kernel runs KVM for real, and the KVM selftest dirty_log_perf_test runs a
nested guest on it. Eager splitting is off by default in 6.12; the
selftests carry a test-only patch that gives dirty_log_perf_test and
dirty_log_test an option, -S <bytes>, that sets KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE
(kernel/arm64-split/bench/selftests-eager-split-option.patch).

Both kernels carry a test-only patch (kernel/arm64-split/bench/split-walk-stats.patch)
that counts, per page-table level, the entries the split walk visits, and
the nanoseconds spent in kvm_pgtable_stage2_split() with mmu_lock held.
The guest runs with -icount shift=0 and one vCPU: guest time advances one
nanosecond per executed instruction, so those nanoseconds are the
instructions the split executed (interrupts included, nothing else runs on
the CPU while mmu_lock is held for write). A software model's timings mean
nothing for hardware; its instruction and visit counts are work, and that
is all this scenario reports.

Per case (backing x manual protect), dirty_log_perf_test -S <chunk> -m 6 (4 KiB guest
pages, 40-bit IPA; -m 8 with guest_page_kib=64) -v 1 -b <mib>M -i <iterations> -s <backing>, with -g
when manual protect is off: then the whole memslot is split when dirty
logging is enabled (KVM_SET_USER_MEMORY_REGION2); with manual protect the
split happens in KVM_CLEAR_DIRTY_LOG, 64 pages at a time. Also reported:
the test's own "Enabling dirty logging" and "Clear dirty log" times, in
virtual ns (instructions of the whole ioctl, as user space sees it; with
one L1 vCPU they include whatever else ran meanwhile, which is why the
selftest's vCPU threads wait with sched_yield() in the lab's build), next
to the source document's change of the same ioctl (DOCUMENT).

Stock and series boots alternate (ABBA) over `rounds`.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from ..shell import LabError
from ..stats import median_ratio
from . import Outcome, Scenario, table

STATS_PATCH = "split-walk-stats.patch"
# What counting one visit adds to the walk (split-walk-stats.patch; read
# off the disassembly of the -O2 kernels' __kvm_pgtable_walk, stock and the
# series): a compare and branch on the walker (every walk pays these two,
# the same in both kernels) and a load/add/store of the counter with its
# address: 7 instructions at the last level, 8 above it (an index; stock
# keeps the counters' address in a register on one path, 6 there, which
# leaves stock's figures at most 2 instructions per upper-level visit too
# low, <0.04M for a whole run). Subtracted from the ioctl figures, which
# would otherwise bill stock for its extra visits.
STATS_INSNS_PER_VISIT = (8, 8, 8, 7)
# What timing one kvm_pgtable_stage2_split() call adds (split-walk-stats.patch,
# read off the disassembly of the -O2 kernels, the same code in stock and
# the series): two calls of ktime_get(), 46 instructions each on its common
# path (33 of its own, the clocksource read through two calls 13), the
# copy of the first reading, and the two counters' update (102 in all
# inside the chunk loop, 104 for the last chunk of a range). Subtracted
# from the ioctl figures too: a kernel that skips a split call would
# otherwise be credited with it. (-Os kernels: 129, ktime_get() 58.)
STATS_INSNS_PER_CALL = 103
# both kernels without test code (kernel/configs/arm64-split-bench.config)
BENCH_FRAGMENT = "arm64-split-bench.config"
STATS = "/sys/module/kvm/parameters/split_walk_stats"
BACKINGS = ("anonymous", "anonymous_thp", "anonymous_hugetlb")
# opt-in: 1 GiB blocks (a boot-time pool of 1 GiB pages in the L1 guest)
HUGE_1G = "anonymous_hugetlb_1gb"
VARIANTS = tuple(harness.family("split"))
# the series step by step (harness FAMILIES["split"]): what each adds
STEPS = {
    "p1-3": "patches 1-3 (walk skips tables of pages: the document's change)",
    "p1-4": "+ 4 (table built in one pass)",
    "p1-5": "+ 5 (no split where write protection saw no block)",
    "series": "+ 6 (write protection's own walker)",
}
# the step that makes the source document's change, beside which its figures go
DOCUMENT_STEP = "p1-3"
# dirty_log_perf_test -m, by guest page size in KiB: 40-bit IPA, 48-bit VA
GUEST_MODES = {4: 6, 16: 7, 64: 8}
# The source document's figures (hardware time, the mean over its guest
# modes): change of the ioctl, by (backing, manual protect). Its hugetlb
# rows are 1 GiB pages.
DOCUMENT = {
    ("anonymous", "off"): -44.01, ("anonymous", "on"): -38.98,
    ("anonymous_thp", "off"): -24.66, ("anonymous_thp", "on"): -25.49,
    (HUGE_1G, "off"): -24.78, (HUGE_1G, "on"): -24.24,
}
MAX_MIB = 4096
LEVELS = 4  # levels 0-3 of a 4 KiB granule, 48-bit input address

GUEST_SCRIPT = """\
echo 1 > {stats}
grep -q . {stats} || exit 3
dmesg | grep -E 'kvm \\[1\\]: (VHE|Hyp|nVHE)' || true
echo {hugepages} > /proc/sys/vm/nr_hugepages
run_case() {{
\techo 1 > {stats}
\trc=0
\tout=$(/kvm/dirty_log_perf_test -S {chunk} -m {mode} -v 1 \\
\t\t-b {mib}M -i {iterations} -s "$1" $2 2>&1) || rc=$?
\techo "$out"
\ten=$(echo "$out" | sed -n 's/^Enabling dirty logging time: \\([0-9.]*\\)s.*/\\1/p')
\tcl=$(echo "$out" | sed -n 's/^Clear dirty log over .* took \\([0-9.]*\\)s\\..*/\\1/p')
\tprintf '{{"prog":"split","backing":"%s","manual":"%s","rc":%d,"enable_s":"%s",' \\
\t\t"$1" "${{2:-manual}}" "$rc" "$en"
\tprintf '"clear_s":"%s","stats":"%s"}}\\n' "$cl" "$(cat {stats})"
}}
"""


@dataclass(frozen=True)
class Params:
    backings: tuple[str, ...] = BACKINGS
    # manual protect off (split at dirty-log enable) and on (split at clear)
    manual: tuple[str, ...] = ("off", "on")
    mib: int = 256  # the test memslot (one vCPU)
    iterations: int = 2  # dirty_log_perf_test needs two
    rounds: int = 2
    chunk_bytes: int = 2 << 20  # KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE
    kvm_mode: str = "vhe"  # or nvhe: kvm-arm.mode=nvhe
    mem_mib: int = 0  # L1 guest RAM; 0: enough for the memslot
    guest_page_kib: int = 4  # the nested guest's page size: 4, 16 or 64
    timeout_s: float = 3600
    # the kernels: stock, the series, and its steps (STEPS) for a table per step
    variants: tuple[str, ...] = ("stock", "series")


def guest_script(p: Params) -> str:
    head = GUEST_SCRIPT.format(stats=STATS, hugepages=p.mib // 2 + 8, chunk=p.chunk_bytes,
                               mode=GUEST_MODES[p.guest_page_kib], mib=p.mib, iterations=p.iterations)
    cases = [f"run_case {b} {'-g' if m == 'off' else ''}".rstrip()
             for b in p.backings for m in p.manual]
    return head + "\n".join(cases) + "\n"


def parse_stats(text: str) -> dict[str, Any]:
    """"calls C ns N visits L0 L1 L2 L3 breaks B" (split-walk-stats.patch) -> numbers.

    breaks: valid blocks a map walk broke into a table, i.e. split faults
    (a fault mapping a page inside a block); absent from older kernels' lines."""
    m = re.fullmatch(r"calls (\d+) ns (\d+) visits (\d+) (\d+) (\d+) (\d+)(?: breaks (\d+))?",
                     text.strip())
    if not m:
        raise LabError(f"split: unexpected {STATS} content {text!r}")
    nums = [int(x) for x in m.groups()[:6]]
    out: dict[str, Any] = {"split_calls": nums[0], "split_insns": nums[1],
                           "visits_by_level": nums[2:]}
    if m.group(7) is not None:
        out["split_faults"] = int(m.group(7))
    return out


def seconds_to_insns(text: str) -> int | None:
    """dirty_log_perf_test's "S.NNNNNNNNN" seconds: under -icount shift=0, instructions."""
    if not text:
        return None
    sec, _, frac = text.partition(".")
    return int(sec) * 10**9 + int((frac + "000000000")[:9])


def parse_record(rec: dict[str, Any]) -> dict[str, Any]:
    if rec.get("rc") != 0:
        raise LabError(f"split: dirty_log_perf_test failed for {rec.get('backing')} "
                       f"(manual {rec.get('manual')}, exit {rec.get('rc')})")
    out = {"backing": rec["backing"], "manual": "off" if rec["manual"] == "-g" else "on"}
    out.update(parse_stats(rec["stats"]))
    out["enable_ioctl_insns"] = seconds_to_insns(rec.get("enable_s", ""))
    out["clear_ioctls_insns"] = seconds_to_insns(rec.get("clear_s", ""))
    # every split of the case happens in the ioctl it times: at enable with
    # manual protect off, in KVM_CLEAR_DIRTY_LOG with it on
    overhead = sum(n * v for n, v in zip(STATS_INSNS_PER_VISIT, out["visits_by_level"]))
    overhead += STATS_INSNS_PER_CALL * out["split_calls"]
    out["stats_overhead_insns"] = overhead
    key = "enable_ioctl_insns" if out["manual"] == "off" else "clear_ioctls_insns"
    out["ioctl_net_insns"] = None if out[key] is None else out[key] - overhead
    return out


def summarise_cases(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per case: medians per variant, the series/stock ratio of split instructions."""
    cases: list[dict[str, Any]] = []
    keys = sorted({(r["backing"], r["manual"]) for rs in samples.values() for r in rs},
                  key=lambda k: ((*BACKINGS, HUGE_1G).index(k[0]), k[1]))
    for backing, manual in keys:
        case: dict[str, Any] = {"backing": backing, "manual": manual}
        for variant in VARIANTS:
            rs = [r for r in samples.get(variant, [])
                  if (r["backing"], r["manual"]) == (backing, manual)]
            if not rs:
                continue
            case[variant] = {
                "split_insns_median": statistics.median(r["split_insns"] for r in rs),
                "split_calls": rs[0]["split_calls"],
                "visits_by_level": rs[0]["visits_by_level"],
                "visits_identical_across_rounds": all(
                    r["visits_by_level"] == rs[0]["visits_by_level"] for r in rs),
                # blocks broken in the fault path over the whole test, every round
                "split_faults": [r.get("split_faults") for r in rs],
                "enable_ioctl_insns_median": _median_or_none(
                    [r["enable_ioctl_insns"] for r in rs]),
                "clear_ioctls_insns_median": _median_or_none(
                    [r["clear_ioctls_insns"] for r in rs]),
                "ioctl_net_insns_median": _median_or_none(
                    [r.get("ioctl_net_insns") for r in rs]),
                "ioctl_net_insns": [r.get("ioctl_net_insns") for r in rs],
                "samples": len(rs),
            }
            case[variant + "_split_insns"] = [r["split_insns"] for r in rs]
        if "stock" in case and "series" in case and case["stock"]["split_insns_median"]:
            case["ratio_split_insns"] = median_ratio(case["stock_split_insns"],
                                                     case["series_split_insns"]).as_dict()
        cases.append(case)
    return cases


def _median_or_none(xs: list[int | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _m(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e6:.2f}"


def render(cases: list[dict[str, Any]]) -> str:
    rows = []
    for c in cases:
        st, se = c.get("stock", {}), c.get("series", {})
        ratio = c.get("ratio_split_insns")
        rows.append([
            c["backing"], c["manual"],
            _m(st.get("split_insns_median")), _m(se.get("split_insns_median")),
            f"{ratio['ratio']:.3f} ({(ratio['ratio'] - 1) * 100:+.1f}%)" if ratio else "n/a",
            "/".join(str(v) for v in st.get("visits_by_level", [])),
            "/".join(str(v) for v in se.get("visits_by_level", [])),
            _m(st.get("enable_ioctl_insns_median" if c["manual"] == "off"
                      else "clear_ioctls_insns_median")),
            _m(se.get("enable_ioctl_insns_median" if c["manual"] == "off"
                      else "clear_ioctls_insns_median")),
            _faults(st), _faults(se),
        ])
    return table(["backing", "manual", "split Minsn stock", "series", "series/stock",
                  "visits L0/L1/L2/L3 stock", "series", "ioctl Minsn stock", "series",
                  "split faults stock", "series"], rows)


def _faults(v: dict[str, Any]) -> str:
    """Split faults of a variant's rounds: "0", or each round's where they differ."""
    got = [f for f in v.get("split_faults", []) if f is not None]
    if not got:
        return "n/a"
    return str(got[0]) if len(set(got)) == 1 else "/".join(map(str, got))


def _change(stock: float | None, series: float | None) -> float | None:
    return None if not stock or series is None else (series / stock - 1) * 100


def _document(c: dict[str, Any]) -> float | None:
    doc = DOCUMENT.get((c["backing"], c["manual"]))
    if doc is None and c["backing"] == "anonymous_hugetlb":
        doc = DOCUMENT[(HUGE_1G, c["manual"])]  # the document's hugetlb is 1 GiB pages
    return doc


def _ioctl(c: dict[str, Any]) -> str:
    return "enable (manual off)" if c["manual"] == "off" else "clear (manual on)"


def render_ioctls(cases: list[dict[str, Any]]) -> str:
    """The ioctl as user space sees it (less the counting of visits), stock
    and the series. The source document's change (hardware time, of the walk
    skip alone) is not this change: it goes beside patches 1-3 (render_steps)."""
    rows = []
    for c in cases:
        key = "ioctl_net_insns_median"
        st, se = c.get("stock", {}).get(key), c.get("series", {}).get(key)
        change = _change(st, se)
        rows.append([c["backing"], _ioctl(c), _m(st), _m(se),
                     "n/a" if change is None else f"{change:+.1f}%"])
    return table(["backing", "ioctl", "net Minsn stock", "series", "change"], rows)


def render_steps(cases: list[dict[str, Any]]) -> str:
    """The ioctl's emulator instructions (net of the counting) per step of the
    series, each with its change from stock; the source document's figure
    (hardware time) beside the step that makes the same change."""
    steps = [v for v in STEPS if any(v in c for c in cases)]
    rows = []
    for c in cases:
        key = "ioctl_net_insns_median"
        st = c.get("stock", {}).get(key)
        row = [c["backing"], _ioctl(c), _m(st)]
        for v in steps:
            got = c.get(v, {}).get(key)
            change = _change(st, got)
            row.append(f"{_m(got)} ({'n/a' if change is None else f'{change:+.1f}%'})")
            if v == DOCUMENT_STEP:
                doc = _document(c)
                row.append("n/a" if doc is None else f"{doc:+.1f}%")
        row.append(" / ".join(_faults(c.get(v, {})) for v in ("stock", *steps)))
        rows.append(row)
    head = ["backing", "ioctl", "stock"]
    for v in steps:
        head.append(v)
        if v == DOCUMENT_STEP:
            head.append("document (hw time)")
    head.append("split faults " + "/".join(("stock", *steps)))
    legend = "\n".join(f"  {v}: {STEPS[v]}" for v in steps)
    return (table(head, rows) + "\nemulator instructions of the ioctl, millions (change from "
            "stock), not time; the document's figures are hardware time of patches 1-3's "
            "change; split faults: blocks broken in the fault path over the whole test\n"
            + legend)


class Split(Scenario):
    name = "split"
    Params = Params
    platforms = ("arm64",)
    needs = "KVM arm64 inside the guest"

    def run(self, ctx: RunContext, params: Any) -> Outcome:
        p: Params = params
        for b in p.backings:
            if b not in (*BACKINGS, HUGE_1G):
                raise LabError(f"split: unknown backing {b!r}; choose from "
                               f"{', '.join((*BACKINGS, HUGE_1G))}")
        if HUGE_1G in p.backings and p.mib % 1024:
            raise LabError(f"split: {HUGE_1G} needs mib to be a multiple of 1024")
        if not set(p.manual) <= {"off", "on"} or not p.manual:
            raise LabError("split: manual is a list of off,on")
        if not 2 <= p.mib <= MAX_MIB or p.mib % 2:
            raise LabError(f"split: mib must be even, 2..{MAX_MIB}")
        if p.guest_page_kib not in GUEST_MODES:
            raise LabError(f"split: guest_page_kib is one of {', '.join(map(str, GUEST_MODES))}")
        if p.kvm_mode not in ("vhe", "nvhe"):
            raise LabError("split: kvm_mode is vhe or nvhe")
        if BENCH_FRAGMENT not in ctx.extra_fragments:
            ctx = ctx.on(ctx.platform, extra_fragments=(*ctx.extra_fragments, BENCH_FRAGMENT))
        if "stock" not in p.variants:
            raise LabError("split: variants must include stock, the baseline")
        variants = [v.with_patches(STATS_PATCH)
                    for v in harness.pick(self.name, "split", p.variants)]
        # the build directory names carry each kernel's key (series, config)
        kernels = {v.name: str(harness.kernel(ctx, v)) for v in variants}
        mem = p.mem_mib or max(1024, 2 * p.mib + 512)
        cmdline = ["kvm-arm.mode=nvhe"] if p.kvm_mode == "nvhe" else []
        if HUGE_1G in p.backings:
            # 1 GiB pages are only sure to be found at boot
            cmdline += ["hugepagesz=1G", f"hugepages={p.mib // 1024}", "hugepagesz=2M"]
            mem = p.mem_mib or mem + p.mib
        plan = self.plan(p, guest_script(p), "split", mem_mib=mem, cmdline=tuple(cmdline),
                         icount=True, smp=1)
        ctx.initrd(plan.initrd, plan.script)
        samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for rnd in range(p.rounds):
            for variant in harness.order(variants, rnd):
                if not ctx.shell.dry_run:
                    print(f"split: round {rnd + 1}/{p.rounds}, {variant.name}", flush=True)
                booted = harness.boot(ctx, variant, f"split-{variant.name}-r{rnd}", plan)
                if booted is not None:
                    samples[variant.name] += [parse_record(r) for r in booted.records("split")]
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "split: dry run, nothing measured")
        cases = summarise_cases(samples)
        data = {"params": asdict(p), "cases": cases, "kernels": kernels,
                "units": "instructions (QEMU -icount shift=0: 1 virtual ns per instruction)",
                "samples": samples}
        ctx.save("split", data)
        head = (f"eager split, memslot {p.mib} MiB, 1 vCPU, {p.guest_page_kib} KiB guest "
                f"pages, chunk "
                f"{p.chunk_bytes >> 20} MiB, KVM {p.kvm_mode}; work in millions of guest "
                "instructions (QEMU TCG -icount shift=0), never a time")
        text = head + "\n" + render(cases) + "\n\n" + render_ioctls(cases)
        if any(v in STEPS and v != "series" for v in p.variants):
            text += "\n\nstep by step:\n" + render_steps(cases)
        return Outcome(self.name, data, text)

"""zeromix: the order-0 hit rate of "never zero twice" under a mixed workload.

zeroskip measures right after a forced full report.  Here page reporting
runs on its own (2 s after frees, about a sixteenth of each free list per
pass) while zeroing allocations are interleaved with non-zeroing ones and
frees.  Per cycle, in one boot:
  1. write a tmpfs file of file_mib MiB from /dev/urandom (page cache:
     full-page shmem writes do not clear, so they may use up known-zero
     pages without benefit),
  2. populate anon_mib MiB of 4 KiB anonymous memory (zeroing allocations),
     verify it reads zero, fill it, free it,
  3. delete the file (frees),
  4. stay idle idle_s s, so reporting runs on its own.
The pgzero_* counters are read at the start and end of each cycle and
around its populate.  The flush knob is used at most once, before the first
cycle (initial_flush), so the run starts from a reported state.

Variants, alternating ABBA over `rounds` boots, all on the patched series
with reported pages known zero (bit 6 negotiated: the patched QEMU of qemu/,
or vhost-user-balloon on UML):
  on            the series
  on+<patch>    the series plus the test-only kernel/bench/<patch>.patch,
                e.g. on+no-zero-preference
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .. import guestshell, harness
from ..context import RunContext
from ..guestshell import flush_cmd
from ..shell import LabError
from ..stats import median_ratio, quantile, summarise
from . import Outcome, Scenario, table

FILE = "/tmp/zeromix.file"
# counters every snapshot must carry (pages); the other pgzero_* come along
COUNTERS = ("pgzero_skipped", "pgzero_missed", "pgzero_marked_reported", "pgzero_merge_lost")
PAGES_PER_MIB = 256  # 4 KiB pages, on x86_64 and UML alike
# snapshots of a cycle, in order; "populate"/"populated" bracket the populate
POINTS = ("start", "populate", "populated", "end")

# snap CYCLE POINT: one JSON line with the pgzero_* counters and nr_free_pages
SNAPSHOT_FUNCTION = r"""snap() {
	""" + guestshell.VMSTAT_ALL + r""" | awk -v c="$1" -v at="$2" \
	'/^(pgzero_[a-z_]+|nr_free_pages) / { s = s sprintf(",\"%s\":%s", $1, $2) }
	END { printf "{\"prog\":\"vmstat\",\"cycle\":%d,\"at\":\"%s\"%s}\n", c, at, s }'
}"""


@dataclass
class ZeromixParams:
    mem_mib: int = 1024
    cycles: int = 12
    file_mib: int = 96
    anon_mib: int = 128
    idle_s: int = 4
    initial_flush: bool = True
    variants: tuple[str, ...] = ("on",)
    rounds: int = 2
    # cycles from this index on are "steady state"; -1: the second half
    steady_from: int = -1
    # -1: 1000 on UML (one CPU, whose per-cpu lists would otherwise hold
    # much of the free memory away from reporting), kernel default on QEMU
    pcp_high_fraction: int = -1
    timeout_s: int = 900

    def steady_start(self) -> int:
        return self.cycles // 2 if self.steady_from < 0 else self.steady_from


def variant_patches(variant: str) -> tuple[str, ...]:
    """'on' -> (), 'on+a+b' -> ('a.patch', 'b.patch') from kernel/bench/."""
    base, *names = variant.split("+")
    if base != "on" or not all(names):
        raise LabError(f"zeromix: bad variant {variant!r}: expected 'on' or 'on+<patch>' "
                       "(kernel/bench/<patch>.patch)")
    return tuple(f"{n}.patch" for n in names)


# pcp_high_fraction=-1: per platform (UML: one CPU, whose per-cpu lists
# would otherwise hold much of the free memory away from reporting)
DEFAULT_PCP_HIGH_FRACTION = {"uml": 1000}


def pcp_high_fraction(p: ZeromixParams, platform: str) -> int:
    if p.pcp_high_fraction >= 0:
        return p.pcp_high_fraction
    return DEFAULT_PCP_HIGH_FRACTION.get(platform, 0)


def guest_script(p: ZeromixParams, platform: str) -> str:
    lines = [SNAPSHOT_FUNCTION]
    fraction = pcp_high_fraction(p, platform)
    if fraction:
        lines.append(guestshell.pcp_high_fraction(fraction))
    lines.append("snap -1 boot")
    if p.initial_flush:
        lines += [flush_cmd(), "snap -1 flushed"]
    lines += [
        "i=0",
        f"while [ $i -lt {p.cycles} ]; do",
        "\tsnap $i start",
        # page cache: allocations that do not clear
        f"\tdd if=/dev/urandom of={FILE} bs=1M count={p.file_mib} iflag=fullblock 2>/dev/null",
        "\tsnap $i populate",
        # zeroing allocations; exit 1 = a non-zero byte: the host judges that
        f"\tpopulate --mib {p.anon_mib} --mode 4k --verify --fill 0x5a --tag cycle-$i"
        " || [ $? -eq 1 ]",
        "\tsnap $i populated",
        f"\trm {FILE}",
        # no flush: reporting runs on its own timer
        f"\tsleep {p.idle_s}",
        "\tsnap $i end",
        "\ti=$((i + 1))",
        "done",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Cycle:
    """One cycle of one boot; counter deltas in pages."""

    cycle: int
    populate_cpu_ms: float
    populate_wall_ms: float
    nonzero_bytes: int
    around_populate_pages: dict[str, int]
    whole_cycle_pages: dict[str, int]

    @property
    def hit_rate(self) -> float | None:
        return hit_rate(self.around_populate_pages)


@dataclass
class Boot:
    cycles: list[Cycle]
    initial_flush_pages: dict[str, int]  # deltas over the initial flush ({} without one)
    total_pages: dict[str, int]  # deltas from the first cycle's start to the last one's end


def hit_rate(deltas: dict[str, int]) -> float | None:
    done = deltas.get("pgzero_skipped", 0) + deltas.get("pgzero_missed", 0)
    return deltas.get("pgzero_skipped", 0) / done if done else None


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a if k in b and k.startswith("pgzero_")}


def json_lines(lines: Iterable[str]) -> list[dict]:
    out = []
    for text in lines:
        text = text.strip()
        if text.startswith('{"prog":'):
            try:
                out.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    return out


def parse_console(lines: Iterable[str]) -> Boot:
    """A boot's cycles from its console lines (the guest's vmstat and populate JSON)."""
    records = json_lines(lines)
    snaps: dict[tuple[int, str], dict[str, int]] = {}
    for r in records:
        if r["prog"] == "vmstat":
            missing = [c for c in COUNTERS if c not in r]
            if missing:
                raise LabError(f"zeromix: the guest has no {', '.join(missing)} "
                               f"({guestshell.ZEROED_STAT}: not the patched series?)")
            snaps[(r["cycle"], r["at"])] = {k: v for k, v in r.items() if isinstance(v, int)}
    pops = {r["tag"]: r for r in records if r["prog"] == "populate"}
    cycles = []
    i = 0
    while (i, "start") in snaps:
        absent = [p for p in POINTS if (i, p) not in snaps]
        if absent or f"cycle-{i}" not in pops:
            raise LabError(f"zeromix: cycle {i} is incomplete (no "
                           f"{', '.join(absent) or 'populate'} record)")
        s = {p: snaps[(i, p)] for p in POINTS}
        pop = pops[f"cycle-{i}"]
        cycles.append(Cycle(i, pop["populate_cpu_ns"] / 1e6, pop["populate_ns"] / 1e6,
                            pop["nonzero_bytes"], _delta(s["populate"], s["populated"]),
                            _delta(s["start"], s["end"])))
        i += 1
    if not cycles:
        raise LabError("zeromix: no complete cycle on the console")
    flush = (_delta(snaps[(-1, "boot")], snaps[(-1, "flushed")])
             if (-1, "flushed") in snaps and (-1, "boot") in snaps else {})
    total = _delta(snaps[(0, "start")], snaps[(len(cycles) - 1, "end")])
    return Boot(cycles, flush, total)


def median_difference(a: list[float], b: list[float], iterations: int = 2000,
                      seed: int = 1) -> dict[str, float]:
    """median(b) - median(a) with a bootstrap 95% interval (as stats.median_ratio)."""
    if not a or not b:
        raise ValueError("both sides need samples")
    rng = random.Random(seed)
    boots = [statistics.median([rng.choice(b) for _ in b])
             - statistics.median([rng.choice(a) for _ in a]) for _ in range(iterations)]
    return {"difference": statistics.median(b) - statistics.median(a),
            "lo": quantile(boots, 0.025), "hi": quantile(boots, 0.975)}


def _sum(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _hits(cycles: Iterable[Cycle]) -> list[float]:
    return [h for h in (c.hit_rate for c in cycles) if h is not None]


def _summary(xs: list[float]) -> dict | None:
    return summarise(xs).as_dict() if xs else None


def summarise_variant(boots: list[Boot], steady_from: int) -> dict[str, Any]:
    """Everything the JSON keeps about one variant; rates are fractions, counts pages."""
    cycles = [c for b in boots for c in b.cycles]
    steady = [c for b in boots for c in b.cycles if c.cycle >= steady_from]
    per_index = {i: _hits(b.cycles[i] for b in boots if i < len(b.cycles))
                 for i in range(max(len(b.cycles) for b in boots))}
    return {
        "hit_rate": _summary(_hits(cycles)),
        "hit_rate_pooled": hit_rate(_sum(c.around_populate_pages for c in cycles)),
        "hit_rate_first_cycle": _summary(_hits(b.cycles[0] for b in boots)),
        "hit_rate_steady": _summary(_hits(steady)),
        "hit_rate_steady_pooled": hit_rate(_sum(c.around_populate_pages for c in steady)),
        "hit_rate_by_cycle_median": {str(i): statistics.median(h) if h else None
                                     for i, h in per_index.items()},
        "hit_rate_per_boot_pooled": [hit_rate(_sum(c.around_populate_pages for c in b.cycles))
                                     for b in boots],
        "marked_reported_pages_per_cycle": _summary(
            [c.whole_cycle_pages["pgzero_marked_reported"] for c in cycles]),
        "merge_lost_pages_per_cycle": _summary(
            [c.whole_cycle_pages["pgzero_merge_lost"] for c in cycles]),
        "skipped_pages_per_populate": _summary(
            [c.around_populate_pages["pgzero_skipped"] for c in cycles]),
        "missed_pages_per_populate": _summary(
            [c.around_populate_pages["pgzero_missed"] for c in cycles]),
        "populate_cpu_ms": _summary([c.populate_cpu_ms for c in cycles]),
        "populate_wall_ms": _summary([c.populate_wall_ms for c in cycles]),
        "around_populate_pages_total": _sum(c.around_populate_pages for c in cycles),
        "run_pages_total": _sum(b.total_pages for b in boots),
        "initial_flush_pages_total": _sum(b.initial_flush_pages for b in boots),
        "boots": [{"initial_flush_pages": b.initial_flush_pages, "run_pages": b.total_pages,
                   "cycles": [{**asdict(c), "hit_rate": c.hit_rate} for c in b.cycles]}
                  for b in boots],
    }


def compare(a: list[Boot], b: list[Boot], steady_from: int) -> dict[str, Any]:
    """b against a: hit-rate differences (fractions), populate time ratios."""
    ca = [c for boot in a for c in boot.cycles]
    cb = [c for boot in b for c in boot.cycles]
    sa = [c for c in ca if c.cycle >= steady_from]
    sb = [c for c in cb if c.cycle >= steady_from]
    out: dict[str, Any] = {}
    if _hits(ca) and _hits(cb):
        out["hit_rate_difference"] = median_difference(_hits(ca), _hits(cb))
    if _hits(sa) and _hits(sb):
        out["hit_rate_steady_difference"] = median_difference(_hits(sa), _hits(sb))
    for key in ("populate_cpu_ms", "populate_wall_ms"):
        xa = [getattr(c, key) for c in ca]
        xb = [getattr(c, key) for c in cb]
        if statistics.median(xa):
            out[f"ratio_{key}"] = median_ratio(xa, xb).as_dict()
    return out


def _pct(s: dict | None) -> str:
    return "n/a" if s is None else f"{s['median'] * 100:.0f}% [{s['p25'] * 100:.0f}-{s['p75'] * 100:.0f}]"


def _mib(s: dict | None) -> str:
    if s is None:
        return "n/a"
    return (f"{s['median'] / PAGES_PER_MIB:.1f} [{s['p25'] / PAGES_PER_MIB:.1f}-"
            f"{s['p75'] / PAGES_PER_MIB:.1f}]")


def _ms(s: dict | None) -> str:
    return "n/a" if s is None else f"{s['median']:.1f} [{s['p25']:.1f}-{s['p75']:.1f}]"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.0f}%"


def report(platform: str, params: ZeromixParams,
           boots: dict[str, list[Boot]]) -> tuple[dict[str, Any], str]:
    """JSON data and the text table of a run."""
    steady_from = params.steady_start()
    data: dict[str, Any] = {
        "platform": platform, "params": asdict(params), "steady_from_cycle": steady_from,
        "pcp_high_fraction": pcp_high_fraction(params, platform),
        "units": {"hit_rate*": "fraction of the pages of zeroing allocations around each "
                               "populate that were known zero",
                  "*_pages*": "4 KiB pages", "*_ms": "milliseconds"},
        "variants": {v: summarise_variant(boots[v], steady_from) for v in params.variants},
        "comparisons": {},
    }
    rows: list[list[object]] = []
    for v in params.variants:
        e = data["variants"][v]
        first = e["hit_rate_first_cycle"]
        steady = e["hit_rate_steady"]
        rows.append([v, _pct(e["hit_rate"]), _rate(e["hit_rate_pooled"]),
                     _rate(first and first["median"]), _pct(steady),
                     _mib(e["marked_reported_pages_per_cycle"]),
                     _mib(e["merge_lost_pages_per_cycle"]), _ms(e["populate_cpu_ms"]),
                     _ms(e["populate_wall_ms"]), e["hit_rate"]["n"] if e["hit_rate"] else 0])
    base = params.variants[0]
    for v in params.variants[1:]:
        cmp = compare(boots[base], boots[v], steady_from)
        data["comparisons"][f"{v} vs {base}"] = cmp

        def diff(key: str, c: dict[str, Any] = cmp) -> str:
            if key not in c:
                return "n/a"
            d = c[key]
            return f"{d['difference'] * 100:+.1f} pp [{d['lo'] * 100:+.1f}, {d['hi'] * 100:+.1f}]"

        def ratio(key: str, c: dict[str, Any] = cmp) -> str:
            if key not in c:
                return "n/a"
            r = c[key]
            return f"{r['ratio']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}]"

        rows.append([f"{v} - {base}", diff("hit_rate_difference"), "", "",
                     diff("hit_rate_steady_difference"), "", "",
                     ratio("ratio_populate_cpu_ms"), ratio("ratio_populate_wall_ms"), ""])
    by_cycle = "\n".join(
        f"  {v}: " + " ".join("-" if h is None else f"{h * 100:.0f}"
                              for h in data["variants"][v]["hit_rate_by_cycle_median"].values())
        for v in params.variants)
    text = (f"zeromix ({platform}, {params.cycles} cycles x {params.rounds} boots, each: "
            f"{params.file_mib} MiB tmpfs write, {params.anon_mib} MiB 4 KiB populate, frees, "
            f"{params.idle_s} s idle; hit = pgzero_skipped / (skipped + missed) around each "
            f"populate, median [p25-p75] over cycles; pooled = over all cycles; steady = cycles "
            f">= {steady_from}; MiB and ms per cycle, median [p25-p75])\n"
            + table(["variant", "hit", "pooled", "first", "steady", "marked MiB",
                     "merge lost MiB", "populate cpu ms", "populate wall ms", "n"], rows)
            + "\nhit % by cycle (median over boots):\n" + by_cycle)
    return data, text


class Zeromix(Scenario):
    name = "zeromix"
    Params = ZeromixParams

    @staticmethod
    def _boot(params: ZeromixParams, booted: harness.Booted) -> Boot:
        guest = booted.guest
        lines = booted.lines
        boot = parse_console(lines)
        bad = [c for c in boot.cycles if c.nonzero_bytes]
        if bad:
            raise guest.error(f"zeromix: {bad[0].nonzero_bytes} non-zero bytes in cycle "
                              f"{bad[0].cycle}'s populate: a page called zero was not")
        if len(boot.cycles) != params.cycles:
            raise guest.error(f"zeromix: {len(boot.cycles)} of {params.cycles} cycles ran")
        return boot

    def run(self, ctx: RunContext, params: ZeromixParams) -> Outcome:
        if not ctx.patched:
            raise LabError("zeromix counts the series' pgzero_* events: drop --vanilla")
        if not params.variants:
            raise LabError("zeromix: no variants")
        if params.cycles < 1:
            raise LabError("zeromix: cycles must be >= 1")
        # every kernel before the first boot: a bench patch that does not
        # apply should not cost a boot first
        variants = [harness.Variant(v, patched=True, extra_patches=variant_patches(v),
                                    zeroing=True) for v in params.variants]
        for variant in variants:
            harness.kernel(ctx, variant)
        boots: dict[str, list[Boot]] = {v: [] for v in params.variants}
        plan = self.plan(params, guest_script(params, ctx.platform), f"zeromix-{ctx.platform}")
        for booted in harness.rounds(ctx, variants, params.rounds, f"zeromix-{ctx.platform}",
                                     plan):
            boots[booted.variant.name].append(self._boot(params, booted))
        if ctx.shell.dry_run:
            return Outcome(self.name, {}, "(dry run)")
        data, text = report(ctx.platform, params, boots)
        ctx.save(f"zeromix-{ctx.platform}", data)
        return Outcome(self.name, data, text)

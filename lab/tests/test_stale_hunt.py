"""The stale-page hunt: every producer of zero pages at once, for a fixed time.

"A page we call zero is zero, in every path." One UML guest (the series,
debug variant: CONFIG_DEBUG_PAGE_ZEROED reads every page the allocator
hands out as known zero and counts a non-zero one in pgzero_verify_failed)
runs, all at the same time:

* `fragment`: memory fragmented in holes of every small order, refilled
  and unmapped, round after round; every page it faults in must read zero;
* compaction: `echo 1 > /proc/sys/vm/compact_memory` once a second;
* free page reporting to vhost-user-balloon, which zeroes (discards) what
  the guest reports and says so (bit 6), and the guest takes its word;
* pre-zeroing (kprezerod at cpu_percent 50);
* the balloon inflated and deflated from the host every 2 s (bit 7: the
  deflated pages come back known zero);
* a verified 4 KiB populate every 2 s.

Then the host deflates the balloon and a verified populate takes what is
left of free memory. The counters are taken from a mark after boot (the
KUnit suites at boot make non-zero "zero" pages on purpose). The test
fails on any pgzero_verify_failed, any non-zero byte, any kernel warning,
and on a producer that produced nothing or compaction that moved nothing
(a hunt in which nothing happened proves nothing).

FREEPAGE_STALE_HUNT_S sets the length of the churn (default 60 s);
FREEPAGE_STALE_HUNT_PATCH=<kernel/bench patch> runs it against a broken
kernel (prezero-last-page-dirty.patch: the test must fail).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from freepage_lab import guestshell, harness, kernel
from freepage_lab.harness import kernel_warnings
from freepage_lab.initramfs import EVENT

SECONDS = int(os.environ.get("FREEPAGE_STALE_HUNT_S", "60"))
BROKEN_PATCH = os.environ.get("FREEPAGE_STALE_HUNT_PATCH", "")
MEM_MIB = 512
FRAGMENT_MIB = 128
POPULATE_MIB = 32
# the balloon swings between these (pages of 4 KiB): up to 96 MiB, down to < 16 MiB
BALLOON_HIGH = (8192, 24576)
BALLOON_LOW = (0, 4096)
SWING_S = 2.0
SEED = 20261126
BIT_DEVICE_INIT_ON_INFLATE = 7

COUNTERS = (
    "pgzero_marked_reported", "pgzero_marked_prezero", "pgzero_marked_freed",
    "pgzero_marked_init_on_free", "pgzero_skipped", "pgzero_missed", "pgzero_merge_lost",
    "pgzero_verify_failed", "pgzero_prezero_aborted",
    "compact_stall", "compact_success", "compact_fail", "compact_migrate_scanned",
    "compact_free_scanned", "compact_isolated", "pgmigrate_success", "pgmigrate_fail",
    "balloon_inflate", "balloon_deflate", "balloon_migrate",
)
# each must grow during the churn, or the hunt did not hunt: reporting (bit
# 6), pre-zeroing, deflate (bit 7: free_zeroed_page), compaction that scanned
# and moved pages, and allocations that took known zero pages (and so were
# verified)
PRODUCED = ("pgzero_marked_reported", "pgzero_marked_prezero", "pgzero_marked_freed",
            "compact_migrate_scanned", "pgmigrate_success", "pgzero_skipped")
EVENT_RE = re.compile(rf"^{EVENT} (\S+)((?: \S+ -?\d+)*)\s*$")


def script(seconds: int) -> str:
    """The guest: the producers and the churn for `seconds`, then the final check."""
    prezero = guestshell.PREZERO_DIR
    counters = "|".join(COUNTERS)
    return f"""{guestshell.BALLOON_BOUND}
echo "{EVENT} features {guestshell.BALLOON_FEATURES}"
{guestshell.pcp_high_fraction(1000)}
[ -w /proc/sys/vm/compact_memory ] || {{ echo 'stale-hunt: no compaction' >&2; exit 3; }}
{guestshell.require_prezero("stale-hunt")}
echo 50 > {prezero}/cpu_percent
echo 1 > {prezero}/enabled
vm() {{ {guestshell.VMSTAT_ALL} | grep -E '^({counters}) ' | tr '\\n' ' '; }}
up() {{ read -r u _ < /proc/uptime; echo "${{u%.*}}"; }}
balloon() {{ awk '/^balloon_inflate /{{i=$2}} /^balloon_deflate /{{d=$2}} END{{print i - d}}' \\
\t/proc/vmstat; }}
end=$(( $(up) + {seconds} ))
echo "{EVENT} start $(vm)"
( while [ "$(up)" -lt $end ]; do echo 1 > /proc/sys/vm/compact_memory; sleep 1; done ) &
compactor=$!
( while [ "$(up)" -lt $end ]; do
\tpopulate --mib {POPULATE_MIB} --mode 4k --verify --tag hunt || echo "{EVENT} failed populate $?"
\tsleep {SWING_S:g}
done ) &
verifier=$!
rc=0
fragment --mib {FRAGMENT_MIB} --seconds {seconds} --sleep-ms 200 --tag churn || rc=$?
wait $compactor || rc=$?
wait $verifier || rc=$?
echo "{EVENT} churned rc $rc $(vm)"
# the host deflates the balloon when it sees "churned"
sleep 3
i=0
while [ "$(balloon)" -ne 0 ]; do
\ti=$((i + 1))
\t[ $i -le 120 ] || {{ echo 'stale-hunt: the balloon did not deflate' >&2; exit 5; }}
\tsleep 0.5
done
echo "{EVENT} deflated $(vm)"
free_mib=$(awk '/^MemFree:/{{print int($2 / 1024)}}' /proc/meminfo)
populate --mib $((free_mib - 32)) --mode 4k --verify --tag final || rc=$?
echo 0 > {prezero}/enabled
echo "{EVENT} end $(vm)"
exit $rc
"""


def parse_events(lines: Sequence[str]) -> dict[str, dict[str, int]]:
    """name -> its "counter value" pairs, of every event line (the last of a name)."""
    out = {}
    for line in lines:
        m = EVENT_RE.match(line.strip())
        if m:
            words = m.group(2).split()
            out[m.group(1)] = {k: int(v) for k, v in zip(words[::2], words[1::2])}
    return out


def delta(events: dict[str, dict[str, int]], a: str, b: str) -> dict[str, int]:
    assert a in events and b in events, f"events {a} and {b} wanted, got {list(events)}"
    return {k: v - events[a].get(k, 0) for k, v in events[b].items() if k in COUNTERS}


@dataclass
class Hunt:
    """What one hunt left: the console, its records and the host's side."""

    rc: int
    lines: list[str]
    records: list[dict]
    features: str = ""
    targets: list[int] = field(default_factory=list)
    daemon: dict = field(default_factory=dict)
    seconds: float = 0.0


def check(hunt: Hunt, seconds: int) -> dict[str, dict[str, int]]:
    """Every assertion of the hunt; returns the counter deltas (churn, total)."""
    events = parse_events(hunt.lines)
    total = delta(events, "start", "end")
    churn = delta(events, "start", "churned")
    # stale pages: what a program read, then what the debug check found
    # (and cleared before anyone could read it)
    verified = [r for r in hunt.records if r.get("prog") in ("populate", "fragment")]
    dirty = [r for r in verified if r.get("nonzero_bytes", 0) != 0 or not r.get("verified")]
    assert not dirty, f"non-zero bytes in fresh memory: {dirty}"
    assert "pgzero_verify_failed" in total, "no debug verification in this kernel"
    assert total["pgzero_verify_failed"] == 0, \
        f"{total['pgzero_verify_failed']} pages handed out as zero were not: {total}"
    assert not kernel_warnings(hunt.lines), kernel_warnings(hunt.lines)
    assert hunt.rc == 0, f"guest script failed (exit {hunt.rc}): {hunt.lines[-20:]}"
    assert "failed" not in events, events["failed"]
    # and the hunt hunted
    hunts = [r for r in verified if r.get("tag") == "hunt"]
    fragments = [r for r in verified if r.get("prog") == "fragment"]
    finals = [r for r in verified if r.get("tag") == "final"]
    assert len(hunts) >= seconds // 10, f"{len(hunts)} verified populates in {seconds} s"
    assert len(fragments) == 1 and fragments[0]["rounds"] >= 2, fragments
    assert len(finals) == 1 and finals[0]["mib"] >= MEM_MIB // 2, finals
    bits = hunt.features
    assert len(bits) > BIT_DEVICE_INIT_ON_INFLATE, f"features {bits!r}"
    assert bits[guestshell.BIT_DEVICE_INIT_REPORTED] == "1", f"bit 6 not negotiated: {bits}"
    assert bits[BIT_DEVICE_INIT_ON_INFLATE] == "1", f"bit 7 not negotiated: {bits}"
    idle = [k for k in PRODUCED if churn.get(k, 0) <= 0]
    assert not idle, f"nothing happened in {idle} during the churn: {churn}"
    assert churn["balloon_inflate"] > 0 and churn["balloon_deflate"] > 0, churn
    assert len(hunt.targets) >= seconds // (2 * SWING_S), hunt.targets
    return {"churn": churn, "total": total}


def seen(lines: Sequence[object], pattern: str) -> bool:
    rx = re.compile(pattern)
    return any(rx.search(getattr(ln, "text", "")) for ln in list(lines))


def hunt(lab, seconds: int, extra_patches: tuple[str, ...] = ()) -> Hunt:
    """Boot, swing the balloon until the churn ends, deflate it, wait for the exit."""
    ctx = lab.context("uml", patched=True, variant="debug")
    # reporting, bits 6 and 7 offered and taken
    variant = harness.Variant("stale-hunt", zeroing=None, extra_patches=extra_patches)
    rng = random.Random(SEED)
    targets: list[int] = []
    t0 = time.monotonic()
    # the harness offers bits 6 and 7 (the daemon's x- flags) and has the
    # guest take them (virtio_balloon.device_init=1)
    with lab.start(ctx, "stale-hunt", script(seconds), variant, mem_mib=MEM_MIB,
                   timeout_s=seconds + 600) as run:
        g, backend = run.guest, run.backend
        assert backend is not None
        _, _, m = g.wait_for(rf"^{EVENT} features ([01]+)", 600)
        run.mark("start")
        churned = rf"^{EVENT} churned "
        high = True
        while not seen(g.lines, churned):
            assert g.alive(), g.tail()
            assert time.monotonic() - t0 < seconds + 600, "the churn did not end"
            pages = rng.randrange(*(BALLOON_HIGH if high else BALLOON_LOW))
            reply = backend.request({"cmd": "set_target", "pages": pages})
            assert reply["ok"], reply
            targets.append(pages)
            high = not high
            swing_end = time.monotonic() + SWING_S
            while time.monotonic() < swing_end and not seen(g.lines, churned):
                time.sleep(0.1)
        assert backend.request({"cmd": "set_target", "pages": 0})["ok"]
        rc = run.wait_exit()
        daemon = backend.request({"cmd": "get_counters"})
    return Hunt(rc, run.booted.lines, run.booted.records(), m.group(1), targets,
                daemon, time.monotonic() - t0)


def report(hunt: Hunt, counts: dict[str, dict[str, int]]) -> str:
    recs = hunt.records
    frag = next((r for r in recs if r.get("prog") == "fragment"), {})
    pops = [r for r in recs if r.get("prog") == "populate"]
    c = hunt.daemon.get("counters", {})
    return "\n".join([
        f"stale hunt: {SECONDS} s of churn, {hunt.seconds:.0f} s in all, exit {hunt.rc}",
        f"fragment: {frag.get('rounds')} rounds, {frag.get('faulted_pages')} pages faulted in "
        f"and checked, {frag.get('nonzero_bytes')} non-zero bytes",
        f"populate --verify: {len(pops)} runs, {sum(r['mib'] for r in pops)} MiB, "
        f"{sum(r['nonzero_bytes'] for r in pops)} non-zero bytes",
        f"balloon: {len(hunt.targets)} targets set; daemon inflated "
        f"{c.get('inflated_pages')} deflated {c.get('deflated_pages')} pages, "
        f"reported {c.get('reported_bytes', 0) >> 20} MiB",
        "churn: " + " ".join(f"{k}={v}" for k, v in counts["churn"].items()),
        "total: " + " ".join(f"{k}={v}" for k, v in counts["total"].items()),
    ])


@pytest.mark.slow
@pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty")
def test_no_stale_page_under_every_producer_at_once(lab):
    """FREEPAGE_STALE_HUNT_S seconds (default 60) of churn with every
    producer of zero pages at once; no page called zero may hold a byte."""
    patches = (BROKEN_PATCH,) if BROKEN_PATCH else ()
    result = hunt(lab, SECONDS, patches)
    counts = check(result, SECONDS)
    print(report(result, counts))


# -- the checks on made-up hunts (fast) ------------------------------------------

def event_line(name: str, counters: dict[str, int]) -> str:
    return f"{EVENT} {name} " + " ".join(f"{k} {v}" for k, v in counters.items())


def made_up(**change: int) -> Hunt:
    """A hunt that passes every check, but for the counters in `change`."""
    start = {k: 1000 for k in COUNTERS}
    end = {k: 2000 for k in COUNTERS} | {"pgzero_verify_failed": 1000}
    churned = {**end, **{k: v + 1000 for k, v in change.items()}}
    end = {**end, **{k: v + 1000 for k, v in change.items()}}
    lines = ["FREEPAGE-BOOTED 1.0", event_line("start", start),
             event_line("churned", churned), event_line("end", end)]
    records = ([{"prog": "populate", "tag": "hunt", "mib": POPULATE_MIB, "verified": True,
                 "nonzero_bytes": 0}] * 6
               + [{"prog": "fragment", "tag": "churn", "rounds": 9, "verified": True,
                   "nonzero_bytes": 0},
                  {"prog": "populate", "tag": "final", "mib": 400, "verified": True,
                   "nonzero_bytes": 0}])
    return Hunt(0, lines, records, "0" * 6 + "11" + "0" * 24, list(range(20)))


def test_check_passes_a_clean_hunt():
    counts = check(made_up(), 60)
    assert counts["total"]["pgzero_verify_failed"] == 0
    assert counts["churn"]["pgzero_marked_prezero"] == 1000


def test_check_fails_on_a_non_zero_populate():
    bad = made_up()
    bad.records[2] = {**bad.records[2], "nonzero_bytes": 4095}
    with pytest.raises(AssertionError, match="non-zero bytes in fresh memory"):
        check(bad, 60)


def test_check_fails_on_a_failed_verification():
    with pytest.raises(AssertionError, match="1 pages handed out as zero were not"):
        check(made_up(pgzero_verify_failed=1), 60)


@pytest.mark.parametrize("counter", PRODUCED)
def test_check_fails_when_a_producer_did_nothing(counter):
    hunt = made_up()
    hunt.lines[2] = hunt.lines[2].replace(f" {counter} 2000", f" {counter} 1000")
    with pytest.raises(AssertionError, match=f"nothing happened in .*{counter}"):
        check(hunt, 60)


def test_check_fails_on_a_kernel_warning_after_boot():
    hunt = made_up()
    hunt.lines.append("WARNING: CPU: 0 PID: 1 at mm/page_zeroed.c:120 __page_zeroed_verify")
    with pytest.raises(AssertionError, match="WARNING"):
        check(hunt, 60)


def test_check_fails_without_bit_7():
    hunt = made_up()
    hunt.features = "0" * 6 + "10" + "0" * 24
    with pytest.raises(AssertionError, match="bit 7 not negotiated"):
        check(hunt, 60)


def test_script_runs_every_producer_for_the_time_asked():
    text = script(600)
    assert "end=$(( $(up) + 600 ))" in text
    assert "fragment --mib 128 --seconds 600" in text
    assert "echo 1 > /proc/sys/vm/compact_memory" in text
    assert "echo 50 > /sys/kernel/mm/prezero/cpu_percent" in text
    assert "populate --mib 32 --mode 4k --verify --tag hunt" in text

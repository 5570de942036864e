"""The kernel series on real guests: KUnit on UML, verified populates on QEMU and UML."""

import os
import time

import pytest

from freepage_lab import guestshell, harness, kernel, kunit
from freepage_lab.scenarios import zeroskip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]


# KUnit cases that split a free block at pageblock boundaries: UML's
# pageblocks are as large as its largest block, so they skip there
UML_SPLIT_CASES = ("page_zeroed_test_isolate_pageblock_part",)
# KUnit cases that need a pageblock no other CPU touches between their free
# and their check, and skip (saying so) when one took a page of it: on two
# vCPUs that happens in some boots. They run, and must pass, on UML, which
# has one CPU (test_kunit_suites_pass_on_uml allows them no skip).
SMP_RACE_SKIPS = {"page_reporting_test_isolate_movable_block":
                  "a page of the pageblock went elsewhere"}


@pytest.mark.parametrize("cmdline", [[], ["init_on_free=1"]], ids=["default", "init_on_free"])
def test_kunit_suites_pass_on_uml(lab, cmdline):
    """The suite holds whether free pages are zeroed by init_on_free or not."""
    ctx = lab.context("uml", patched=True)
    booted = lab.boot(ctx, "kunit", "true\n", lab.BARE, initrd="k", mem_mib=256,
                      cmdline=tuple(cmdline), timeout_s=300)
    res = kunit.parse(booted.lines)
    assert "page_zeroed" in res.suites, res.suites
    assert res.ok, (res.diagnostics or res.failed, res.suites)
    assert res.suites["page_zeroed"]["pass"] >= 10, res.suites
    # what reporting does with a zero mark: built with the reporting suite
    assert res.suites.get("page_reporting_zeroed", {}).get("pass") == 4, res.suites
    # a case that skips in the configuration the lab builds proves nothing;
    # those that need pageblocks smaller than the largest block run on x86_64
    # (test_kunit_suites_pass_on_qemu_smp)
    assert {k: v for k, v in res.skipped.items() if k not in UML_SPLIT_CASES} == {}, \
        res.skipped
    # the debug check counts what the suite does on purpose instead of warning,
    # also before boot (the harness looks only after it)
    assert not [t for t in booted.lines if "WARNING" in t or "Bad page" in t]


@pytest.mark.parametrize("cmdline", [[], ["init_on_free=1"]], ids=["default", "init_on_free"])
def test_kunit_suites_pass_on_qemu_smp(lab, cmdline):
    """The suites run at boot of the x86_64 guest (loglevel 7 shows their
    KTAP lines). With two CPUs, a CPU's PCP list is not its own while its
    interrupts are off: the PCP cases run beside a kthread that drains
    every CPU's lists in a loop, and none may fail or skip for it (only a
    case of SMP_RACE_SKIPS may skip, for the reason it gives).

    When page_zeroed_test_pcp took the freed page back with the lock
    dropped in between, the drain took it first: "Expected kept to be
    true, but is false", with and without init_on_free. When the drainer
    drained back to back and the case counted a share of rounds, the
    drain won up to 95% of them in some boots: "Expected cycled > round /
    2, but cycled == 1929", one boot in eight."""
    ctx = lab.context("qemu", patched=True)
    booted = lab.boot(ctx, "kunit-smp", "true\n", lab.BARE, mem_mib=2048, smp=2,
                      cmdline=("loglevel=7", *cmdline), timeout_s=600)
    res = kunit.parse(booted.lines)
    assert "page_zeroed" in res.suites, res.suites
    assert res.ok, (res.diagnostics or res.failed, res.suites)
    assert res.suites.get("page_reporting_zeroed", {}).get("pass") == 4, res.suites
    assert {k: v for k, v in res.skipped.items() if SMP_RACE_SKIPS.get(k) != v} == {}, \
        res.skipped
    assert not [t for t in booted.lines if "WARNING" in t or "Bad page" in t]


GIB_PAGES = 1 << 18


def gigantic_rounds(lab, name: str, cmdline: tuple[str, ...]):
    """Allocate, fault (every byte verified), and free one 1 GiB page, twice,
    with init_on_free, which marks every free page zero. Returns the boot and,
    per round in 4 KiB pages, what zeroing allocations skipped and missed (the
    shell's own faults count too) and the pages the debug check found not
    zero (the KUnit suites at boot count some on purpose, hence a delta)."""
    ctx = lab.context("qemu", patched=True)
    h = "/sys/kernel/mm/hugepages/hugepages-1048576kB"
    script = f"""[ -d {h} ] || {{ echo 'no 1 GiB huge page size' >&2; exit 3; }}
vm() {{ awk -v k="$1" '$1 == k {{ print $2 }}' {guestshell.ZEROED_STAT}; }}
for round in 1 2; do
  skipped=$(vm pgzero_skipped); missed=$(vm pgzero_missed); failed=$(vm pgzero_verify_failed)
  # a range can be busy for a moment (pages on their way to the free lists)
  for try in 1 2 3 4 5; do
    echo 1 > {h}/nr_hugepages
    [ "$(cat {h}/nr_hugepages)" = 1 ] && break
    sleep 1
  done
  n=$(cat {h}/nr_hugepages)
  [ "$n" = 1 ] || {{ echo "round $round: $n gigantic pages allocated" >&2; exit 4; }}
  populate --mib 1024 --mode hugetlb-1g --verify --tag "gigantic-$round" || exit 5
  skipped=$(( $(vm pgzero_skipped) - skipped )); missed=$(( $(vm pgzero_missed) - missed ))
  echo "gigantic-zero $round $skipped $missed $(( $(vm pgzero_verify_failed) - failed ))"
  echo 0 > {h}/nr_hugepages
done
cat {guestshell.ZEROED_STAT}
"""
    booted = lab.boot(ctx, name, script, lab.BARE, mem_mib=3072,
                      cmdline=("init_on_free=1", *cmdline))
    text = booted.lines
    assert not [t for t in text if "Bad page" in t or "WARNING" in t], text
    runs = booted.records("populate")
    assert [r["nonzero_bytes"] for r in runs] == [0, 0], runs
    marked = [t for t in text if t.startswith("pgzero_marked_init_on_free ")]
    assert marked and int(marked[0].split()[1]) > 0, "init_on_free marked nothing zero"
    rounds = [[int(v) for v in t.split()[2:]] for t in text if t.startswith("gigantic-zero ")]
    assert len(rounds) == 2, text
    assert [failed for _, _, failed in rounds] == [0, 0], rounds
    return booted, rounds


def test_gigantic_hugetlb_pages_with_init_on_free(lab):
    """A 1 GiB page is assembled from many chunks that init_on_free marked
    zero: a chunk that kept its zeroed state shows up as a bad page on the
    free, a range cleared on the first chunk's word as non-zero bytes (debug
    checks on, the KUnit suites run at boot). The page the first round frees
    comes back zero as a whole: the second round does not clear it again,
    though isolating its pageblocks splits the free blocks it is made of."""
    _, rounds = gigantic_rounds(lab, "gigantic", ())
    skipped, missed, _ = rounds[1]
    assert skipped >= GIB_PAGES and missed < GIB_PAGES // 100, rounds


def test_gigantic_hugetlb_page_of_boot_memory_is_known_zero(lab):
    """init_on_free clears the memory memblock hands over at boot as well:
    with tracking on before that, memory nobody has used since boot is known
    zero, and the first 1 GiB page is not cleared on its fault either. No
    KUnit suites at boot: the pre-zeroing suite puts its test blocks back
    cleared but unmarked, zero without being known zero."""
    _, rounds = gigantic_rounds(lab, "gigantic-boot", ("kunit.enable=0",))
    assert all(skipped >= GIB_PAGES and missed < GIB_PAGES // 100
               for skipped, missed, _ in rounds), rounds


def test_device_init_bit_refused_with_page_poisoning(lab):
    """Bit 6 (DEVICE_INIT_REPORTED) is negotiated on a plain boot and refused
    when pages are poisoned: a page the device zeroes is not a poisoned page."""
    ctx = lab.context("uml", patched=True, variant="debug")
    bit = guestshell.BIT_DEVICE_INIT_REPORTED
    script = f"""f={guestshell.BALLOON_FEATURES}
echo "features $f"
"""
    seen = {}
    for name, cmdline in (("plain", ()), ("poison", ("page_poison=1",))):
        # the daemon offers bits 6 and 7
        booted = lab.boot(ctx, name, script, lab.OFFERED, mem_mib=256, cmdline=cmdline,
                          timeout_s=120)
        line = next(t for t in booted.lines if t.startswith("features "))
        seen[name] = line.split()[1]
        # tracking refuses poisoned pages: its KUnit suite skips instead of
        # freeing pages it expects to stay zero, which poisoning rewrites
        res = kunit.parse(booted.lines)
        assert res.ok, (name, res.diagnostics or res.failed, res.suites)
        assert not [t for t in booted.lines if "memory corruption" in t], name
    assert seen["plain"][bit] == "1", seen
    assert seen["poison"][bit] == "0", seen


def features_line(lines) -> str:
    return next(t for t in lines if t.startswith("features ")).split()[1]


def test_device_init_bits_are_opt_in_and_modern_only(lab):
    """Bits 6 and 7 put the guest's own isolation in the host's hands: the
    driver takes them only with virtio_balloon.device_init=1, and only from a
    modern (VERSION_1) device, whose used lengths it can trust. The daemon
    (UML) and the patched QEMU offer both bits."""
    script = f"""echo "features {guestshell.BALLOON_FEATURES}"
"""
    bits = (guestshell.BIT_DEVICE_INIT_REPORTED, guestshell.BIT_DEVICE_INIT_ON_INFLATE)
    uml = lab.context("uml", patched=True)
    seen = {}
    booted = lab.boot(uml, "opted-in", script, lab.OFFERED, mem_mib=256, timeout_s=120)
    seen["opted-in"] = features_line(booted.lines)
    with lab.start(uml, "not-opted-in", script, lab.OFFERED, mem_mib=256, timeout_s=120,
                   overrides={"cmdline": []}) as run:
        assert run.wait_exit(120) == 0
        seen["not-opted-in"] = features_line(run.booted.lines)
    qemu = lab.context("qemu", patched=True, patched_qemu=True)
    legacy = harness.Variant("legacy", zeroing=True,
                             device_props=("disable-modern=on", "disable-legacy=off"))
    booted = lab.boot(qemu, "legacy", script, legacy, mem_mib=512, timeout_s=300)
    seen["legacy"] = features_line(booted.lines)
    assert [seen["opted-in"][b] for b in bits] == ["1", "1"], seen
    assert [seen["not-opted-in"][b] for b in bits] == ["0", "0"], seen
    assert [seen["legacy"][b] for b in bits] == ["0", "0"], seen


@pytest.mark.parametrize("platform", ["qemu", "uml"])
def test_reported_memory_reads_zero_and_zeroing_is_skipped(lab, platform):
    """Debug verification on: every page handed out as known zero is checked."""
    ctx = lab.context(platform, patched=True)
    scen = zeroskip.Zeroskip()
    params = scen.params({"variants": "on", "rounds": "1", "repeat": "1",
                          "pcp_high_fraction": "1000" if platform == "uml" else "0"})
    out = scen.run(ctx, params)  # raises on a non-zero byte or a kernel warning
    for mode, entry in out.data["modes"].items():
        assert entry["on"]["pgzero_skipped"] > 0, (mode, out.table)


# How the guest polls pgzero_marked_freed while it waits for the inflate and
# the deflate (at most 150 s): with shell builtins every 500 ms, or with awk
# every 100 ms, a fork every 100 ms like a busy guest. The builtin `read`
# takes the counters file a byte at a time (70 ms or more per poll when the
# counters were in /proc/vmstat) and the balloon's work runs between them; the host
# inflates and deflates the test's 64 MiB in about 0.12 s.
DEFLATE_POLLS = {
    "quiet": ("marked() { while read -r k v; do [ \"$k\" = pgzero_marked_freed ] && return; "
              f"done < {guestshell.ZEROED_STAT}; }}", "0.5"),
    "busy": ("marked() { v=$(awk '$1 == \"pgzero_marked_freed\" {print $2}' "
             f"{guestshell.ZEROED_STAT}); }}",
             "0.1"),
}


# `make test` runs both: the busy guest is the case merges used to cost up to
# 55% in; FREEPAGE_DEFLATE_POLLS=busy (or quiet) runs one
RUN_POLLS = os.environ.get("FREEPAGE_DEFLATE_POLLS", "quiet,busy").split(",")
# FREEPAGE_DEFLATE_PATCH=<kernel/bench patch> runs it on the series with that
# test-only patch (pcp-drop.patch: the series without its per-cpu zero lists)
DEFLATE_PATCH = os.environ.get("FREEPAGE_DEFLATE_PATCH", "")


@pytest.mark.parametrize("poll", RUN_POLLS)
def test_deflated_pages_are_known_zero_under_bit_7(lab, poll):
    """UML + vhost-user-balloon offering bit 7 (DEVICE_INIT_ON_INFLATE): inflate
    dirty memory, deflate it, and the deflated pages come back marked zero
    (the device set their bits in the inflate bitmap) and read as zero.

    Reporting is off in the daemon so that only deflate produces zero pages;
    the debug kernel verifies every page whose zeroing it skips. The guest
    then faults in all but 24 MiB of its free memory, so that the deflated
    pages are used up wherever the allocator left them on the free lists:
    a deflated page either comes back as a skipped clearing, lost its state
    (pgzero_merge_lost: it merged with a buddy that was not zero, and the
    merged block was then allocated whole), or stays free.

    Processes forked during the inflate take pages next to the balloon's and
    free them again, so deflated pages merge with free buddies that are not
    zero. Before merged blocks kept the state of their zero sub-blocks, a
    fork every 100 ms ("busy") lost up to 55% of the deflated pages this way
    (docs/results/never-zero-twice.md, "Deflated pages and merges"); both
    polls must now lose at most 5%.
    """
    from freepage_lab.initramfs import EVENT

    ctx = lab.context("uml", patched=True, variant="debug")
    pages = 16384  # 64 MiB
    vmstat = ("grep -E '^pgzero_(marked_freed|merge_lost|skipped|missed|verify_failed) '"
              f" {guestshell.ZEROED_STAT} | tr '\\n' ' '")
    poll_fn, interval = DEFLATE_POLLS[poll]
    # The count the wait starts from is taken before the host hears that the
    # guest is ready: a count taken after could already hold the deflate
    script = f"""echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction
populate --mib 256 --mode 4k --fill 165 --tag warm
{poll_fn}
marked
base=$v
echo "{EVENT} warmed $({vmstat})"
read -r up _ < /proc/uptime
end=$((${{up%.*}} + 150))
until [ $((v - base)) -ge {pages} ]; do
  read -r up _ < /proc/uptime
  [ ${{up%.*}} -ge $end ] && {{ echo 'deflated pages never marked zero' >&2; exit 5; }}
  sleep {interval}
  marked
done
echo "{EVENT} deflated $({vmstat})"
free_mib=$(awk '/^MemFree:/{{print int($2 / 1024)}}' /proc/meminfo)
populate --mib $((free_mib - 24)) --mode 4k --verify --tag measure
echo "{EVENT} populated $({vmstat})"
"""
    # the daemon offers bit 7 and does not report
    variant = harness.Variant("deflate", reporting=False, zeroing=None,
                              extra_patches=(DEFLATE_PATCH,) if DEFLATE_PATCH else ())
    with lab.start(ctx, "deflate", script, variant, mem_mib=512) as run:
        g, backend = run.guest, run.backend
        assert backend is not None
        g.wait_for(rf"^{EVENT} warmed", 60)
        assert backend.request({"cmd": "set_target", "pages": pages})["ok"]
        t0 = time.monotonic()
        while backend.request({"cmd": "get_counters"})["actual"] != pages:
            assert time.monotonic() - t0 < 60, "inflate did not complete in 60 s"
            time.sleep(0.1)
        assert backend.request({"cmd": "set_target", "pages": 0})["ok"]
        assert run.wait_exit(180) == 0
        state = backend.request({"cmd": "get_counters"})
    names = state["features"]["negotiated_names"]
    assert "DEVICE_INIT_ON_INFLATE" in names, names
    events = {m.split()[1]: dict(zip(m.split()[2::2], map(int, m.split()[3::2])))
              for m in (ln.text for ln in g.lines) if m.startswith(EVENT + " ")}

    def delta(name, start, end):
        return events[end][name] - events[start][name]

    marked = delta("pgzero_marked_freed", "warmed", "deflated")
    lost = delta("pgzero_merge_lost", "warmed", "populated")
    skipped = delta("pgzero_skipped", "deflated", "populated")
    print(f"deflated {pages} pages ({poll}): {marked} marked zero, {lost} lost in merges, "
          f"{skipped} zeroing allocations skipped")
    assert marked >= pages, events
    # the KUnit suites at boot fail the check on purpose; the run must add none
    assert delta("pgzero_verify_failed", "warmed", "populated") == 0, events
    # what was neither lost nor allocated is left on the free lists (24 MiB at most)
    assert skipped + lost >= marked - 24 * 256, events
    # merged blocks keep the state of their zero sub-blocks: a busy guest lost up
    # to 55% without that, a quiet one 1-6% (docs/results/never-zero-twice.md)
    assert lost <= 0.05 * pages, events
    assert skipped >= 0.75 * pages, events
    assert not [ln.text for ln in g.lines if "WARNING" in ln.text]


def test_power_off_with_a_report_in_flight(lab):
    """virtio_dev_shutdown() breaks the balloon's queues at power-off: a
    report the device has not acknowledged yet must not hang the machine.

    The daemon holds every discard for 3 s, so the report that the flush
    starts is in flight when the guest powers off; the guest checks that the
    flush still waits before it powers off. Before the driver gave up on a
    broken and reset device, UML hung in page_reporting_unregister() and the
    test failed with "printed its exit marker but did not power off".
    """
    ctx = lab.context("uml", patched=True)
    script = f"""echo 1 > {guestshell.FLUSH} &
sleep 1
[ -d /proc/$! ] || {{ echo 'the flush did not wait for the device' >&2; exit 3; }}
echo 'report in flight: powering off'
"""
    # the daemon holds every discard for 3 s
    variant = harness.Variant("slow-discards", zeroing=None,
                              daemon_args=("--discard-delay-ms", "3000"))
    # raises when the guest does not power off
    text = lab.boot(ctx, "poweroff", script, variant, mem_mib=512, timeout_s=120).lines
    assert "report in flight: powering off" in text, text[-20:]
    assert not [t for t in text if "WARNING" in t or "BUG" in t], text


# page_reporting cases that skip while a reporting device is registered (the
# RT boot has the balloon, to report to it)
DEVICE_CASES = ("page_reporting_test_flush_without_device", "page_reporting_test_policy",
                "page_reporting_test_key_follows_device")
# what PREEMPT_RT with DEBUG_ATOMIC_SLEEP and lockdep print for a sleeping
# lock taken where the caller may not sleep, or a lock order they reject
RT_SPLATS = ("sleeping function called from invalid context", "BUG:",
             "possible circular locking", "inconsistent lock state", "Bad page")


@pytest.mark.gate
def test_rt_kernel_runs_the_series_without_a_splat(lab):
    """The series on PREEMPT_RT with lockdep and DEBUG_ATOMIC_SLEEP
    (kernel/configs/rt.config), two vCPUs: the KUnit suites at boot, then
    memory reported to the zeroing device, populated again (known zero
    pages skip clearing) and pre-zeroing turned on where it is built.
    spinlock_t sleeps on RT: pre-zeroing took zone->lock with preemption
    off, and KUnit cases took pcp->lock and zone->lock with interrupts
    off ("BUG: sleeping function called from invalid context at
    kernel/locking/spinlock_rt.c:48", in page_zeroed_test_pcp, and with
    KUnit off 0.3 s after pre-zeroing was enabled). Pre-zeroing now
    depends on !PREEMPT_RT; the cases stay on their CPU with migration
    disabled there."""
    ctx = lab.context("qemu", patched=True, extra_fragments=("rt.config",))
    script = "\n".join([
        "p=/sys/kernel/mm/prezero/enabled",
        'if [ -e $p ]; then echo 1 > $p && echo "prezero on"; else echo "prezero not built"; fi',
        "populate --mib 256 --mode 4k --fill 0xa5 --tag fill",
        guestshell.flush_cmd(),
        "populate --mib 256 --mode 4k --verify --tag again",
        "sleep 3",
        f"grep -E '^pgzero_(skipped|marked_reported|prezero_cleared) ' {guestshell.ZEROED_STAT}",
    ]) + "\n"
    booted = lab.boot(ctx, "rt", script, harness.Variant("rt", zeroing=True), mem_mib=1024,
                      smp=2, cmdline=("loglevel=7",), timeout_s=900)
    splats = [t for t in booted.lines if any(s in t for s in RT_SPLATS)]
    assert not splats, splats
    res = kunit.parse(booted.lines)
    assert "page_zeroed" in res.suites and "page_reporting" in res.suites, res.suites
    assert res.ok, (res.diagnostics or res.failed, res.suites)
    # the cases that need no device run in the bare boots above
    allowed = {**SMP_RACE_SKIPS, **{k: "a reporting device is registered" for k in DEVICE_CASES}}
    assert {k: v for k, v in res.skipped.items() if allowed.get(k) != v} == {}, res.skipped
    assert any(t.strip() == "prezero not built" for t in booted.lines), \
        "pre-zeroing is built on PREEMPT_RT"
    assert [r["nonzero_bytes"] for r in booted.records("populate")][-1:] == [0]
    skipped = [int(t.split()[1]) for t in booted.lines if t.startswith("pgzero_skipped ")]
    assert skipped and skipped[0] > 0, "no zeroing was skipped: the zero tracking did not run"

"""Free page hinting keeps what the guest writes, in precopy, postcopy and multifd.

The series' guest on the patched QEMU with free page hinting, free page
reporting and the device's zeroing at once fills 700 MiB, frees it (the
freed memory is reported and discarded), then runs `reuse` through the
migration: it allocates, stamps, reads back and frees 256 MiB over and
over, so it keeps reusing pages the guest has just hinted (the balloon
gives them back under that pressure).  Every stamp must read back on the
destination, then a 512 MiB populate there must read zeroes only (a page
taken for known zero that came across with data would not), no kernel
may warn, and the destination guest must get the memory it hinted back;
in precopy also with guest RAM in a shared memfd.

Postcopy: QEMU used to turn hinting off with postcopy-ram, because a
destination that faults on a page the source skipped asked for it in
vain and its faulting thread stalled until postcopy ended.  The patched
source sends a skipped page when the destination asks for it.  Above,
`reuse` mostly recycles pages the source has sent; so a second test
has its guest hold 160 MiB of random data in a file (postcopy's background
stream sends zero pages in no time), slows both streams to 4 MiB/s, switches to postcopy once the source has
skipped the guest's free memory (with postcopy-preempt, so that the pages
asked for do not queue behind the background stream), and then has
the destination's guest fault in 128 MiB of the memory it freed and
reported before the migration (skipped: never sent): that must finish
while the migration is still in postcopy.

Memory the guest reported (discarded on the host) and did not touch since
is neither read nor sent to the destination, whose RAM starts zero: with
reporting and no hinting, the migration sends no zero page for it; with
guest RAM in private anonymous memory and in a shared memfd (as for
vhost-user), whose discarded pages are holes of the file.

With postcopy-ram on, an idle hinted guest still sends little more than
its used memory: stock QEMU does not hint then, and sends the freed
memory.

A free page hint is applied as the guest sends it: the source traces
every hint it applies (ram_free_page_hint), with how many pages the
migration sent while the hint waited for the bitmap.  A RAM pass used to
hold the bitmap for a whole iteration (up to 50 ms): the first hint of an
idle guest waited while the pass sent thousands of pages, and the hints
queued behind it.  Now no hint waits for more than the page being sent.

An idle hinted guest stops only for what it dirtied after the first pass:
with a downtime limit of 2 s, QEMU used to switch over as soon as the
hints made what it had not sent yet look small, and sent the rest of the
first pass (the guest's used memory) with the guest stopped.  And it sends
little more than its used memory.

Baseline, expected to fail (FREEPAGE_HINT_BASELINE=...):
* `no-first-pass`: the patched QEMU with qemu/bench/hint-no-first-pass.patch,
  which switches over in the middle of the first pass (idle: the downtime
  is the rest of the first pass);
* `no-skip-unpopulated`: the patched QEMU with
  qemu/bench/no-skip-unpopulated.patch, which reads and sends RAM the guest
  never wrote or had discarded (reported memory: hundreds of thousands of
  zero pages sent);
* `off-with-postcopy`: the patched QEMU with
  qemu/bench/hint-off-with-postcopy.patch, whose balloon does not hint
  when postcopy-ram is on, as stock QEMU (postcopy: the freed memory is
  sent);
* `no-unskip`: the patched QEMU with qemu/bench/hint-no-unskip.patch, whose
  source ignores a postcopy destination's request for a skipped page
  (the guest's populate waits until postcopy has ended).
* `no-yield`: the patched QEMU with qemu/bench/hint-no-yield.patch, whose
  RAM pass holds the bitmap for its whole iteration again (the first hint
  waits while the pass sends thousands of pages).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from freepage_lab import guestshell, harness, kernel
from freepage_lab.guest import GuestError
from freepage_lab.initramfs import EVENT
from freepage_lab.runners import Qmp
from freepage_lab.scenarios.migrate import (
    Migrate,
    MigrateParams,
    capabilities,
    free_port,
    patched_capabilities,
    wait_status,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]

BASELINE = os.environ.get("FREEPAGE_HINT_BASELINE", "")
BASELINE_PATCHES = {"no-first-pass": "hint-no-first-pass.patch",
                    "no-unskip": "hint-no-unskip.patch",
                    "no-skip-unpopulated": "no-skip-unpopulated.patch",
                    "off-with-postcopy": "hint-off-with-postcopy.patch",
                    "no-yield": "hint-no-yield.patch"}
# an idle guest dirties a few hundred pages after its first pass: sending
# them takes milliseconds; its used memory (~140 MiB) takes hundreds
IDLE_DOWNTIME_MS = 200
MIB = 1 << 20
# the postcopy skipped-page test: both streams' bandwidth; random data the
# guest holds in a tmpfs file (~40 s of postcopy's background stream, against
# the populate's ~7 s); what is left to send once the source has skipped the
# free memory of its 1 GiB guest (its used memory and that file)
PRECOPY_BPS = BACKGROUND_BPS = 4 * MIB
HELD_MIB = 160
SKIPPED_REMAINING = 400 * MIB
# the destination's populate of skipped pages takes ~9 s when they are sent
# as it asks for them; the background stream ~50 s
POPULATE_S = 60
# the idle guest may send this much more than its used memory: page tables
# and free blocks below the hint's 4 MiB
USED_SLACK = 1.15
# the source's trace of every free page hint it applied (qemu/hint-during-pass)
HINT_TRACE = "ram_free_page_hint"
HINT_WAITED = re.compile(rf"{HINT_TRACE} .* waited for bitmap_mutex (\d+) us "
                         r"while (\d+) pages were sent")
SYNC_TRACE = "migration_bitmap_sync_start"
# a hint waits for the page the RAM pass is sending, not for the pass's
# iteration (up to 50 ms, thousands of pages)
HINT_WAIT_PAGES = 16


def context(lab):
    return lab.context("qemu", patched=True,
                       qemu_extra_patches=(BASELINE_PATCHES[BASELINE],) if BASELINE else ())


def migrate(lab, variant: str, mode: str, workload: str, source_args: tuple[str, ...] = (),
            **params: object) -> dict:
    """One migration of the migrate scenario (`params`: MigrateParams fields;
    `source_args`: more QEMU arguments for the source)."""
    p = MigrateParams(**{"rounds": 1, "workloads": (workload,), "modes": (mode,),
                         "timeout_s": 120, **params})
    rec = Migrate().one(context(lab), p, mode, workload, harness.family("migrate")[variant], 0,
                        source_args)
    print(rec)
    return rec


@pytest.mark.parametrize("mode, shared_memfd",
                         [("precopy", False), ("postcopy", False), ("multifd", False),
                          ("precopy", True)],
                         ids=["precopy", "postcopy", "multifd", "precopy-memfd"])
def test_pages_reused_after_a_hint_arrive_with_what_the_guest_wrote(lab, mode,
                                                                     shared_memfd) -> None:
    # postcopy: precopy at 256 MiB/s switches with most of the RAM unsent,
    # and a 32 MiB/s background stream leaves the destination's guest
    # seconds in which it must ask for the pages it touches (a quiet host
    # otherwise pushes the rest before the guest faults on any)
    slow = {"max_bandwidth_mib_s": 256, "postcopy_bandwidth_mib_s": 32} if mode == "postcopy" else {}
    rec = migrate(lab, "hint-reported", mode, "reuse", workload_s=20, postcopy_after_ms=50,
                  shared_memfd=shared_memfd, **slow)
    assert rec["workload_rate"], "reuse did not report"
    if mode == "postcopy":
        assert rec["postcopy_mib"], "the migration completed before it switched to postcopy"
        assert rec["postcopy_requests"], "the postcopy destination asked for no page"
    # the guest holds hinted memory until the migration is done, then frees it
    assert rec["dst_free_mib"] > 400, \
        f"the destination guest has {rec['dst_free_mib']:.0f} MiB free: it kept what it hinted"


def test_an_idle_hinted_guest_sends_little_more_than_its_used_memory(lab) -> None:
    rec = migrate(lab, "hint", "precopy", "idle")
    assert rec["transferred_mib"] <= USED_SLACK * rec["used_mib"], \
        (f"sent {rec['transferred_mib']:.0f} MiB for {rec['used_mib']:.0f} MiB used: "
         "free memory the guest hinted was sent")


def test_free_page_hints_do_not_wait_for_a_ram_pass(lab) -> None:
    log = lab.tmp_path / "src-trace.log"
    rec = migrate(lab, "hint", "precopy", "idle",
                  source_args=("-trace", HINT_TRACE, "-trace", SYNC_TRACE, "-D", str(log)))
    trace = log.read_text()
    # (waited us, pages sent meanwhile) of every hint
    hints = [(int(m[1]), int(m[2])) for m in HINT_WAITED.finditer(trace)]
    # the first sync is the setup's, the second ends the first pass
    syncs = trace.split(SYNC_TRACE)
    during = len(HINT_WAITED.findall(syncs[1])) if len(syncs) > 1 else 0
    waited_us, sent = max(hints, default=(0, 0), key=lambda h: h[1])
    print(f"{len(hints)} hints, {during} during the first pass; the one that waited for "
          f"the most pages: {waited_us / 1000:.1f} ms, {sent} pages sent meanwhile")
    assert during, f"no {HINT_TRACE} during the first pass in {log}: nothing was tested"
    assert sent <= HINT_WAIT_PAGES, \
        (f"a free page hint waited {waited_us / 1000:.0f} ms for the bitmap while the RAM "
         f"pass sent {sent} pages ({rec['transferred_mib']:.0f} MiB sent in all for "
         f"{rec['used_mib']:.0f} MiB used)")


def test_an_idle_hinted_guest_stops_only_for_what_it_dirtied(lab) -> None:
    rec = migrate(lab, "hint", "precopy", "idle", downtime_limit_ms=2000)
    assert rec["downtime_ms"] < IDLE_DOWNTIME_MS, \
        (f"downtime {rec['downtime_ms']} ms for an idle guest: the switchover sent what the "
         f"first pass had not ({rec['transferred_mib']:.0f} MiB sent in all)")


def test_a_postcopy_destination_gets_the_pages_the_source_skipped(lab) -> None:
    ctx = context(lab)
    variant = harness.family("migrate")["hint-reported"]
    script = "\n".join([
        "populate --mib 700 --mode 4k --fill 0xa5 --tag fill",
        guestshell.flush_cmd(),
        # data postcopy's background stream must send (zero pages cost it nothing)
        f"dd if=/dev/urandom of=/tmp/held bs=1M count={HELD_MIB} iflag=fullblock 2>/dev/null",
        f"echo {EVENT} ready",
        "read go",
        "populate --mib 128 --mode 4k --fill 0x5a --tag after",
        f"echo {EVENT} populated",
        "while true; do sleep 1; done",
    ]) + "\n"
    params = MigrateParams(modes=("postcopy",))
    port = free_port()
    boot = dict(initrd="hint-postcopy", mem_mib=1024, interactive=True, timeout_s=300)
    src_qmp, dst_qmp = lab.tmp_path / "src.qmp", lab.tmp_path / "dst.qmp"
    with lab.start(ctx, "src", script, variant, **boot,
                   overrides=dict(qmp_socket=src_qmp)) as src, \
            lab.start(ctx, "dst", script, variant, **boot,
                      overrides=dict(qmp_socket=dst_qmp, incoming="defer")) as dst:
        src.guest.wait_for(rf"^{EVENT} ready", 240)
        qs, qd = Qmp(src_qmp), Qmp(dst_qmp)
        try:
            # preempt: the pages the destination asks for go on their own
            # channel, not behind the slowed background stream
            caps = [*capabilities(params, "postcopy"),
                    {"capability": "postcopy-preempt", "state": True}]
            # the patched QEMU's zero skip on both ends, as the migrate
            # scenario sets it: the source skips the memory the guest reported
            skip = patched_capabilities(params, source=False)
            for q in (qs, qd):
                q.execute("migrate-set-capabilities", capabilities=caps + skip)
            qd.execute("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
            # slow on both streams: precopy does not complete by itself, and
            # postcopy's background stream outlasts the destination's populate
            # by far, so a page it gets in time came because it asked for it
            qs.execute("migrate-set-parameters", **{"max-bandwidth": PRECOPY_BPS,
                                                   "max-postcopy-bandwidth": BACKGROUND_BPS})
            qs.execute("migrate", uri=f"tcp:127.0.0.1:{port}")
            # postcopy starts once the source skips the guest's free memory
            before = wait_status(qs, "postcopy", (), 120,
                                 also=lambda i: i.get("ram", {}).get("remaining", MIB << 10)
                                 < SKIPPED_REMAINING)
            qs.execute("migrate-start-postcopy")
            wait_status(qs, "postcopy", ("postcopy-active", "completed"), 120)
            dst.guest.send("go")
            t0 = time.monotonic()
            try:
                dst.guest.wait_for(rf"^{EVENT} populated", POPULATE_S)
            except GuestError as e:
                now = qs.execute("query-migrate")
                assert isinstance(now, dict)
                pytest.fail(f"the destination's guest did not fault in 128 MiB of skipped pages "
                            f"in {POPULATE_S} s (migration {now.get('status')}, "
                            f"{now.get('ram', {}).get('postcopy-requests')} requests, "
                            f"{now.get('ram', {}).get('remaining')} bytes left): the source "
                            f"did not send the pages it asked for ({e})")
            took = time.monotonic() - t0
            status = qs.execute("query-migrate")
            assert isinstance(status, dict)
            qs.execute("migrate-set-parameters", **{"max-postcopy-bandwidth": 0})
            info = wait_status(qs, "postcopy", ("completed",), 240)
        finally:
            qs.close()
            qd.close()
        warnings = harness.kernel_warnings(dst.booted.lines)
    ram = info.get("ram", {})
    print(f"postcopy started with {before['ram']['remaining'] >> 20} MiB left; "
          f"populate took {took:.1f} s, migration {status.get('status')} then; "
          f"{ram.get('postcopy-requests')} requests, {ram.get('postcopy-bytes', 0) >> 20} MiB "
          f"in postcopy, {info.get('total-time')} ms in all")
    assert not warnings, warnings
    assert status.get("status") == "postcopy-active", \
        (f"the destination's guest faulted in 128 MiB of skipped pages in {took:.1f} s, only "
         f"once postcopy had ended: the source did not send the pages it asked for")


@pytest.mark.parametrize("shared_memfd", [False, True], ids=["anonymous", "memfd"])
def test_reported_memory_is_neither_read_nor_sent(lab, shared_memfd) -> None:
    rec = migrate(lab, "reported", "precopy", "idle", shared_memfd=shared_memfd)
    reported_pages = MigrateParams().fill_mib * (MIB // 4096)
    assert rec["zero_pages"] < reported_pages // 10, \
        (f"{rec['zero_pages']} zero pages sent after {reported_pages} pages were reported: "
         "the source read the memory it had discarded and sent it")


def test_hinting_skips_free_memory_with_postcopy_on(lab) -> None:
    rec = migrate(lab, "hint", "postcopy", "idle")
    assert rec["transferred_mib"] <= USED_SLACK * rec["used_mib"], \
        (f"sent {rec['transferred_mib']:.0f} MiB for {rec['used_mib']:.0f} MiB used with "
         "postcopy-ram on: the guest's free memory was not hinted")

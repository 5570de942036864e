"""Free page reporting that gives memory back in under a second, on real guests.

(a) UML + vhost-user-balloon and (b) QEMU (x86_64, TCG, Debian's QEMU 10):
the guest frees 256 MiB of 4 KiB pages with the kernel's DEFAULT per-cpu
list settings; >= 90% of it must be off the host within 5 s of the free.
(a') the Debian guest (qemu-debian: a Debian 12 root on virtio-blk) reads
and writes files through its page cache and tmpfs while it frees 256 MiB;
once the I/O stops, at least 40% must be off the host within 5 s.
(c) every page_reporting knob refuses out-of-range writes with EINVAL /
ERANGE and a valid write reads back.
(d) sysfs holds the tunables only; the counters and the blocking flush are
in debugfs, and a flush there reports what a free left behind.

FREEPAGE_REPORTING_KERNEL=stock runs the same tests on stock 6.12, where
they must fail (the bug they were written against: stock keeps 4 KiB frees
on the per-cpu lists and reports 1/16 of a free list every 2 s); (a') is
not written against that bug: it needs reporting at all, and the Debian
guest's root, I/O and init to work.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from freepage_lab import harness
from freepage_lab.guestshell import (
    BALLOON_BOUND,
    FLUSH,
    REPORTING_COUNTERS,
    REPORTING_DIR,
    REPORTING_SYSFS,
    REPORTING_TUNABLES,
)
from freepage_lab.initramfs import EVENT
from freepage_lab.scenarios.reclaim_io import IO_PROG, ReclaimIoParams, io_functions, io_rates

pytestmark = pytest.mark.slow
MIB = 1 << 20
FREED_MIB = 256
WITHIN_S = 5.0
PATCHED = os.environ.get("FREEPAGE_REPORTING_KERNEL", "freepage") != "stock"
KERNEL = "freepage" if PATCHED else "stock"
ORDER_PARAM = "/sys/module/page_reporting/parameters/page_reporting_order"
DRIVER = "/sys/bus/virtio/drivers/virtio_balloon"


def released_within(lab, platform: str, mem_mib: int, before: str = "", after_free: str = "",
                    after: str = "") -> tuple[float, float | None, harness.Booted]:
    """Boot, free FREED_MIB of 4 KiB pages; (fraction released by WITHIN_S
    into the window, t90 s into it, the boot). The window opens when the
    guest has run `after_free` after the free (at once without it);
    `before` and `after`: guest shell before the populate and at the end."""
    ctx = lab.context(platform, patched=PATCHED)
    script = f"""{BALLOON_BOUND}
{before}
populate --mib {FREED_MIB} --mode 4k --fill 165 --tag report
echo {EVENT} freed
{after_free}
echo {EVENT} window
sleep {WITHIN_S + 1:.0f}
{after}
"""
    # the context's kernel on Debian's QEMU: only the guest kernel is under test
    variant = harness.Variant(KERNEL, stock_qemu=True, zeroing=None)
    with lab.start(ctx, f"report-{platform}", script, variant, initrd="report", mem_mib=mem_mib,
                   timeout_s=180, footprint_s=0.02) as run:
        freed = run.mark("freed").line
        opened = run.mark("window").line
        while time.monotonic() < opened.t + WITHIN_S + 0.1:
            time.sleep(0.1)
        assert run.wait_exit(60) == 0
    booted = harness.check(run.booted)
    samples = booted.footprint
    rate = run.booted.footprint_hz
    peak = max(s.bytes for s in samples if s.t <= freed.t + 0.1)
    window = [s for s in samples if opened.t <= s.t <= opened.t + WITHIN_S]
    low = min(s.bytes for s in window)
    t90 = next((s.t - opened.t for s in window if peak - s.bytes >= 0.9 * FREED_MIB * MIB), None)
    fraction = (peak - low) / (FREED_MIB * MIB)
    t90_text = "never" if t90 is None else f"{t90:.2f} s"
    if after_free:
        print(f"{platform} {KERNEL}: {(peak - window[0].bytes) / MIB:.0f} of {FREED_MIB} MiB "
              f"released in the {opened.t - freed.t:.1f} s from the free to the window")
    print(f"{platform} {KERNEL}: {(peak - low) / MIB:.0f} of {FREED_MIB} MiB ({fraction:.0%}) "
          f"released within {WITHIN_S:.0f} s of the {'window' if after_free else 'free'}, "
          f"90% at {t90_text}, sampled at {rate:.0f} Hz")
    return fraction, t90, booted


def test_uml_gives_back_90_percent_of_4k_frees_within_5s(lab):
    fraction, _, _ = released_within(lab, "uml", 1024)
    assert fraction >= 0.9, f"UML, {KERNEL} kernel: only {fraction:.0%} released in {WITHIN_S} s"


def test_qemu_gives_back_90_percent_of_4k_frees_within_5s(lab):
    fraction, _, _ = released_within(lab, "qemu", 1024)
    assert fraction >= 0.9, f"QEMU, {KERNEL} kernel: only {fraction:.0%} released in {WITHIN_S} s"


# of a free in the Debian guest under I/O, what must be back on the host
# within WITHIN_S, and within DEBIAN_IO_T90_S for 90% of it: the I/O's
# allocations leave part of the free in blocks below the reporting order,
# which the series reports down to 64 KiB where most of the pageblock
# around them is free (95% [94-98], 90% within 0.07-0.23 s in the
# reclaim-io runs; down to 256 KiB, 90-92%, 90% after 1.1 s to never;
# without pieces 55-69%: docs/results/page-reporting.md, reporting under
# file I/O); without reporting nothing comes back
DEBIAN_IO_RELEASED = 0.9
DEBIAN_IO_T90_S = 1.0
# the Debian guest's file I/O in its tests: 32 MiB/s in 4 MiB chunks
DEBIAN_IO = ReclaimIoParams(io_mib_s=32, io_chunk_mib=4)


# outside make test (`make test-debian` runs it beside the one below): the
# Debian guest's boot in make test is the held-passes test
@pytest.mark.gate
def test_debian_guest_reads_and_writes_files_and_gets_its_free_back_when_the_io_stops(lab):
    """The Debian guest (Debian 12 root on virtio-blk, the lab's init) reads
    and writes files through its page cache and tmpfs while it frees, for
    3 s; then the I/O stops, and at least DEBIAN_IO_RELEASED of the free
    must be back on the host within 5 s."""
    fraction, _, booted = released_within(
        lab, "qemu-debian", 1024, f"cat /etc/debian_version\n{io_functions(DEBIAN_IO)}\nio_start",
        "sleep 3\nio_stop")
    assert any(re.fullmatch(r"12\.\d+", ln.strip()) for ln in booted.lines), \
        "the script did not run in the Debian 12 root"
    rates = io_rates(booted.records(IO_PROG))
    print(f"I/O: {rates['io']:.1f} MiB/s ({', '.join(f'{k} {v:.1f}' for k, v in rates.items())})")
    assert all(rates[w] > 0 for w in ("read", "disk_write", "tmpfs_write")), rates
    assert fraction >= DEBIAN_IO_RELEASED, (
        f"Debian guest, {KERNEL} kernel: only {fraction:.0%} released within {WITHIN_S} s of "
        "the I/O's end")


# passes the series may hold back while the Debian guest does file I/O
# for the 6 s after a free (the I/O's programs take anonymous memory now
# and then, which holds a pass for one delay); held for the allocator's
# traffic alone, every 100 ms look was held, 123-726 per boot
DEBIAN_IO_HELD_MAX = 10


# in make test: the Debian guest boots the QEMU platform's kernel, so this
# costs the cached image and one boot
@pytest.mark.skipif(not PATCHED, reason="held passes are the series' counter")
def test_debian_guest_doing_file_io_holds_no_report(lab):
    """File I/O moves page cache through the allocator at a few times its
    own rate but reuses nothing the guest freed: a free while the I/O runs
    must not hold the reporting passes behind it, and at least
    DEBIAN_IO_RELEASED of it must be back within 5 s (90% within
    DEBIAN_IO_T90_S), the I/O still on."""
    held = f"cat {REPORTING_DIR}/held_passes"
    fraction, t90, booted = released_within(
        lab, "qemu-debian", 1024, f"{io_functions(DEBIAN_IO)}\nio_start\nsleep 2",
        f"echo \"HELD before $({held})\"",
        f"echo \"HELD after $({held})\"\nio_stop")
    count = {ln.split()[1]: int(ln.split()[2]) for ln in booted.lines if ln.startswith("HELD ")}
    rates = io_rates(booted.records(IO_PROG))
    print(f"I/O: {rates['io']:.1f} MiB/s; held passes {count}")
    assert rates["io"] > 0, rates
    assert count["after"] - count["before"] <= DEBIAN_IO_HELD_MAX, (
        f"{count['after'] - count['before']} passes held while the guest did file I/O "
        f"({rates['io']:.1f} MiB/s)")
    assert fraction >= DEBIAN_IO_RELEASED, (
        f"only {fraction:.0%} of the free released within {WITHIN_S} s, the I/O running")
    assert t90 is not None and t90 <= DEBIAN_IO_T90_S, (
        f"90% of the free released {'never' if t90 is None else f'after {t90:.2f} s'}, "
        f"not within {DEBIAN_IO_T90_S} s, the I/O running")


# (knob, value, what the kernel must answer); the order is the module parameter
REFUSED = (("order", "11", "Invalid argument"), ("order", "-1", "Invalid argument"),
           ("delay_ms", "60001", "Invalid argument"), ("delay_ms", "abc", "Invalid argument"),
           ("budget_pages", "2147483648", "Invalid argument"),
           ("budget_pages", "4294967296", "Numerical result out of range"),
           ("batch", "0", "Invalid argument"), ("batch", "33", "Invalid argument"))
ACCEPTED = (("delay_ms", "250"), ("batch", "16"), ("budget_pages", "0"))


def knob_path(knob: str) -> str:
    return ORDER_PARAM if knob == "order" else f"{REPORTING_SYSFS}/{knob}"


def test_every_knob_refuses_out_of_range_writes(lab):
    ctx = lab.context("uml", patched=PATCHED)
    lines = []
    for knob, value, _ in REFUSED:
        lines.append(f"if err=$( (echo {value} > {knob_path(knob)}) 2>&1 ); then "
                     f"echo 'KNOB {knob}={value} accepted'; "
                     f"else echo \"KNOB {knob}={value} refused: $err\"; fi")
    for knob, value in ACCEPTED:
        path = knob_path(knob)
        lines.append(f"echo {value} > {path}; echo \"KNOB {knob} reads $(cat {path})\"")
    # UML: no balloon without a daemon
    with lab.start(ctx, "knobs", "\n".join(lines) + "\n", lab.BARE, mem_mib=256) as run:
        run.wait_exit(60)
        out = [t.strip() for t in run.booted.lines if t.startswith("KNOB ")]
    print("\n".join(out))
    for knob, value, error in REFUSED:
        line = next(ln for ln in out if ln.startswith(f"KNOB {knob}={value} "))
        assert "refused" in line and error in line, line
    for knob, value in ACCEPTED:
        assert any(re.fullmatch(rf"KNOB {knob} reads {value}", ln) for ln in out), out


def flush_line(tag: str) -> str:
    """Guest shell: flush, and print `tag ok` or `tag failed: <error>`."""
    return (f'if err=$( (echo 1000000 > {FLUSH}) 2>&1 ); then echo "{tag} ok"; '
            f'else echo "{tag} failed: $err"; fi')


def test_sysfs_holds_the_tunables_and_a_debugfs_flush_reports(lab):
    """/sys/kernel/mm/page_reporting holds delay_ms, budget_pages and batch,
    nothing else; the counters are in debugfs, and a flush there, with the
    delay too long for a pass to run on its own, reports a free at once.
    With the driver unbound the flush answers ENODEV; bound again (the
    reporting key off, then on), it reports again."""
    ctx = lab.context("uml", patched=PATCHED)
    counters = " ".join(REPORTING_COUNTERS)
    script = f"""{BALLOON_BOUND}
echo "SYSFS $(ls {REPORTING_SYSFS} | sort | tr '\\n' ' ')"
echo "DEBUGFS $(ls {REPORTING_DIR} | sort | tr '\\n' ' ')"
echo 60000 > {REPORTING_SYSFS}/delay_ms
sleep 1
before=$(awk '{{s=0; for (i = 1; i <= NF; i++) s += $i; print s}}' {REPORTING_DIR}/reported_pages)
populate --mib 64 --mode 4k --tag flush
{flush_line("FLUSH")}
after=$(awk '{{s=0; for (i = 1; i <= NF; i++) s += $i; print s}}' {REPORTING_DIR}/reported_pages)
echo "REPORTED $((after - before))"
for f in {counters}; do echo "COUNTER $f $(cat {REPORTING_DIR}/$f)"; done
dev=$(basename $(ls -d {DRIVER}/virtio*))
echo $dev > {DRIVER}/unbind
{flush_line("UNBOUND")}
echo $dev > {DRIVER}/bind
{BALLOON_BOUND}
populate --mib 64 --mode 4k --tag rebound
{flush_line("REBOUND")}
"""
    tags = ("SYSFS", "DEBUGFS", "FLUSH", "REPORTED", "COUNTER", "UNBOUND", "REBOUND")
    with lab.start(ctx, "debugfs", script, lab.PLAIN, mem_mib=512, timeout_s=180) as run:
        run.wait_exit(90)
        out = [t.strip() for t in run.booted.lines if t.startswith(tags)]
    print("\n".join(out))
    sysfs = next(ln for ln in out if ln.startswith("SYSFS"))
    assert sysfs.split()[1:] == sorted(REPORTING_TUNABLES), sysfs
    debugfs = next(ln for ln in out if ln.startswith("DEBUGFS")).split()[1:]
    assert set(debugfs) >= {*REPORTING_COUNTERS, "current_delay_ms", "flush"}, debugfs
    assert "FLUSH ok" in out, out
    reported = int(next(ln for ln in out if ln.startswith("REPORTED")).split()[1])
    # 64 MiB freed, reported in blocks of the reporting order by the flush alone
    assert reported >= 64 * MIB // 4096 // 2, out
    unbound = next(ln for ln in out if ln.startswith("UNBOUND"))
    assert "No such device" in unbound, unbound
    assert "REBOUND ok" in out, out
    assert not [t for t in run.booted.lines if "WARNING:" in t or "BUG:" in t]

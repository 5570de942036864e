"""User-Mode Linux + vhost-user-balloon end to end: reporting, inflate/deflate, reconnects.

Every test boots the stock (vanilla) UML kernel against the real daemon
(`freepage_lab.backend.BalloonBackend`) and measures the UML memory file
(allocated blocks of the deleted file UML maps as its RAM).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from freepage_lab import harness
from freepage_lab.backend import BalloonBackend
from freepage_lab.context import RunContext
from freepage_lab.footprint import Sampler
from freepage_lab.guest import Guest
from freepage_lab.initramfs import EVENT

pytestmark = pytest.mark.slow
MIB = 1 << 20
PAGE = 4096
BOUND = ("ls -d /sys/bus/virtio/drivers/virtio_balloon/virtio0 >/dev/null || "
         "{ echo 'no virtio_balloon device bound' >&2; exit 4; }")
# UML is UP: without this, freed 4 KiB pages may sit on the per-cpu lists
# forever and are never reported.
PCP = "echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction"
MEMINFO = "echo \"MEM $(awk '/MemTotal/{t=$2} /MemFree/{f=$2} END{print t, f}' /proc/meminfo)\""


@contextmanager
def daemon(ctx: RunContext, *extra: str) -> Iterator[BalloonBackend]:
    backend = BalloonBackend(ctx.shell, ctx.run_dir / "balloon.sock", ctx.log("backend"),
                             list(extra))
    backend.start()
    try:
        yield backend
    finally:
        backend.stop()


@contextmanager
def guest(lab, ctx: RunContext, backend: BalloonBackend, name: str, script: str) -> Iterator[Guest]:
    """A guest booted by the harness, served by the test's daemon (which outlives it)."""
    with lab.start(ctx, name, script, lab.PLAIN, mem_mib=512, daemon=backend) as run:
        yield run.guest


@contextmanager
def booted(lab, ctx: RunContext, name: str, script: str,
           *flags: str) -> Iterator[tuple[Guest, BalloonBackend]]:
    """A guest and the daemon the harness runs for it (`flags`: the daemon's)."""
    variant = harness.Variant(name, zeroing=None, daemon_args=flags)
    with lab.start(ctx, name, script, variant, mem_mib=512) as run:
        assert run.backend is not None
        yield run.guest, run.backend


def memory_file_bytes(ctx: RunContext, g: Guest) -> int:
    value = ctx.runner().footprint_bytes(g)
    assert value is not None, f"{g.name}: UML memory file not found"
    return value


def counters(backend: BalloonBackend) -> dict:
    reply = backend.request({"cmd": "get_counters"})
    assert reply["ok"], reply
    return reply


def wait_until(what: str, cond, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_discarded(what: str, backend, before: dict, freed_bytes: int) -> None:
    """The daemon discarded >= 90% of what the guest freed since `before`."""
    wait_until(what, lambda: counters(backend)["counters"]["discarded_bytes"]
               - before["discarded_bytes"] >= 0.9 * freed_bytes, 10, 0.2)


def next_meminfo(g: Guest, timeout: float = 10) -> tuple[int, int]:
    """(MemTotal, MemFree) in bytes from the first MEM line printed from now on."""
    _, _, m = g.wait_for(r"^MEM (\d+) (\d+)$", timeout, start_index=len(g.lines))
    return int(m.group(1)) * 1024, int(m.group(2)) * 1024


def test_free_page_reporting_releases_what_the_guest_freed(lab):
    """(a) 4k populate with a non-zero fill, free: the file gives >= 90% back."""
    ctx = lab.context("uml")
    freed = 256 * MIB
    script = f"""{BOUND}
{PCP}
sleep 5
echo {EVENT} ready
sleep 1
populate --mib {freed // MIB} --mode 4k --fill 165 --tag report
echo {EVENT} freed
sleep 15
"""
    with booted(lab, ctx, "report", script) as (g, backend), \
            Sampler(lambda: ctx.runner().footprint_bytes(g)) as sampler:
        g.wait_for(rf"^{EVENT} ready$", 60)
        base = counters(backend)["counters"]
        _, freed_line, _ = g.wait_for(rf"^{EVENT} freed$", 60)
        peak = max(s.bytes for s in sampler.samples if s.t <= freed_line.t + 0.5)
        wait_until("the memory file to give back 90% of the freed memory",
                   lambda: peak - memory_file_bytes(ctx, g) >= 0.9 * freed, 12, 0.2)
        time.sleep(1.5)  # let the rest of the report in flight land
        after = memory_file_bytes(ctx, g)
        state = counters(backend)
        assert g.wait_exit(60) == 0
    c = state["counters"]
    released = peak - after
    discarded = c["discarded_bytes"] - base["discarded_bytes"]
    reported = c["reported_bytes"] - base["reported_bytes"]
    print(f"freed {freed / MIB:.0f} MiB, file released {released / MIB:.1f} MiB, "
          f"daemon discarded {discarded / MIB:.1f} MiB in "
          f"{c['reported_ranges'] - base['reported_ranges']} ranges")
    assert released >= 0.9 * freed
    # only the daemon punches holes in the file: it discarded at least what the file lost
    assert discarded >= released - 4 * MIB
    assert discarded >= 0.9 * freed
    assert reported == discarded  # no PAGE_POISON value in use: everything reported is discarded
    assert c["reported_ranges"] > base["reported_ranges"]
    assert c["discard_errors"] == 0
    assert not any(c["rejects"].values()), c["rejects"]
    assert "REPORTING" in state["features"]["negotiated_names"]
    assert state["connected"]


@pytest.mark.parametrize("deflate_on_oom", [True, False], ids=["deflate-on-oom", "no-doom"])
def test_inflate_and_deflate_move_guest_memory_and_shrink_the_file(lab, deflate_on_oom):
    """(b) set_target N: the guest gives N pages; the file shrinks; target 0 gives them back.

    virtio_balloon adjusts totalram (MemTotal) only without DEFLATE_ON_OOM; with
    it, the pages stay counted in MemTotal and MemFree drops instead.
    """
    ctx = lab.context("uml")
    pages = 32768  # 128 MiB
    want = pages * PAGE
    # Reporting off: the warmed-up (dirty) free memory stays allocated in the
    # file, so what inflate takes must show up as released blocks.
    extra = ["--no-reporting"] + ([] if deflate_on_oom else ["--no-deflate-on-oom"])
    # PCP: pages on the per-cpu lists do not count in MemFree; the balloon
    # would take those first and MemFree would drop by less than N pages.
    script = f"""{BOUND}
{PCP}
populate --mib 384 --mode 4k --fill 165 --tag warm
echo {EVENT} warmed
i=0
while [ $i -lt 240 ]; do
  {MEMINFO}
  sleep 0.25
  i=$((i+1))
done
"""
    with booted(lab, ctx, "inflate", script, *extra) as (g, backend):
        g.wait_for(rf"^{EVENT} warmed$", 60)
        total0, free0 = next_meminfo(g)
        file0 = memory_file_bytes(ctx, g)
        reply = backend.request({"cmd": "set_target", "pages": pages})
        assert reply == {"ok": True, "target": pages, "notified": True}
        wait_until("actual == target", lambda: counters(backend)["actual"] == pages, 30)
        total1, free1 = next_meminfo(g)
        file1 = memory_file_bytes(ctx, g)
        assert backend.request({"cmd": "set_target", "pages": 0})["ok"]
        wait_until("actual == 0", lambda: counters(backend)["actual"] == 0, 30)
        total2, free2 = next_meminfo(g)
        state = counters(backend)
    c = state["counters"]
    print(f"MemTotal {total0 // 1024} -> {total1 // 1024} -> {total2 // 1024} KiB, "
          f"MemFree {free0 // 1024} -> {free1 // 1024} -> {free2 // 1024} KiB, "
          f"file {file0 / MIB:.1f} -> {file1 / MIB:.1f} MiB")
    assert c["inflated_pages"] == pages and c["deflated_pages"] == pages
    assert c["discarded_bytes"] == want
    assert not any(c["rejects"].values()), c["rejects"]
    names = state["features"]["negotiated_names"]
    assert ("DEFLATE_ON_OOM" in names) == deflate_on_oom
    if deflate_on_oom:
        assert total1 == total0
        assert free0 - free1 >= 0.9 * want
    else:
        assert total0 - total1 == want
        assert free0 - free1 >= 0.9 * want
    assert file0 - file1 >= 0.9 * want
    assert total2 == total0
    assert free2 >= free0 - 8 * MIB


def test_daemon_survives_a_vanishing_guest_and_serves_the_next_one(lab):
    """(c) a guest killed mid-run, a second guest on the same socket works."""
    ctx = lab.context("uml")
    first = f"""{BOUND}
echo {EVENT} bound
sleep 600
"""
    second = f"""{BOUND}
{PCP}
populate --mib 128 --mode 4k --fill 90 --tag second
echo {EVENT} freed
sleep 8
"""
    with daemon(ctx) as backend:
        with guest(lab, ctx, backend, "first", first) as g1:
            g1.wait_for(rf"^{EVENT} bound$", 60)
            assert counters(backend)["connected"]
        # the guest was killed (SIGTERM/SIGKILL of its process group, no clean removal)
        wait_until("disconnect", lambda: not counters(backend)["connected"], 10)
        assert backend.proc is not None and backend.proc.poll() is None
        before = counters(backend)["counters"]

        with guest(lab, ctx, backend, "second", second) as g2:
            g2.wait_for(rf"^{EVENT} freed$", 60)
            wait_discarded("reports from the second guest", backend, before, 128 * MIB)
            assert g2.wait_exit(60) == 0
        state = wait_until("disconnect", lambda: (s := counters(backend))["connected"] is False
                           and s, 10)
        assert backend.proc.poll() is None
    c = state["counters"]
    assert c["connections"] == 2
    assert before["connections"] == 1
    assert not any(c["rejects"].values()), c["rejects"]


def test_driver_rebind_renegotiates_and_keeps_reporting(lab):
    """unbind + bind re-probes the driver: features again, rings set up again."""
    ctx = lab.context("uml")
    drv = "/sys/bus/virtio/drivers/virtio_balloon"
    script = f"""{BOUND}
{PCP}
sleep 3
echo virtio0 > {drv}/unbind
! ls -d {drv}/virtio0 2>/dev/null
echo virtio0 > {drv}/bind
{BOUND}
echo {EVENT} rebound
populate --mib 128 --mode 4k --fill 165 --tag rebind
echo {EVENT} freed
sleep 8
"""
    with booted(lab, ctx, "rebind", script) as (g, backend):
        g.wait_for(rf"^{EVENT} rebound$", 60)
        before = counters(backend)["counters"]
        g.wait_for(rf"^{EVENT} freed$", 60)
        wait_discarded("reports after the rebind", backend, before, 128 * MIB)
        # power-off removes the device; it must not hang on the reporting vq
        assert g.wait_exit(60) == 0
    text = "\n".join(ln.text for ln in g.lines)
    assert "WARNING:" not in text and "slave reports error" not in text
    assert "probe with driver virtio_balloon failed" not in text

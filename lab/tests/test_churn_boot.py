"""churn on a real UML guest: two short iterations, host probe included (slow)."""

import pytest

from freepage_lab import harness
from freepage_lab.scenarios import churn

pytestmark = pytest.mark.slow


def test_uml_churn_prints_its_line_and_the_host_sees_faults(lab):
    ctx = lab.context("uml", accel="auto")
    p = churn.ChurnParams(mem_mib=256, churn_mib=16, iterations=2, settle_s=1)
    booted = harness.boot(ctx, harness.family("reporting")["stock"], "t",
                          churn.plan(churn.churn_script(p), "t", p.mem_mib, 60))
    assert booted is not None
    boot = churn.measure(booted)
    b = churn.churn_boot(boot)
    rec = next(r for r in boot.records if r["prog"] == "churn")
    assert rec["iterations"] == 2 and all(ms > 0 for ms in rec["alloc_ms"])
    assert b.guest_faults >= 16 * 256  # one per 4 KiB page at least
    assert b.host_faults > 0 and b.vmm_cpu_ms > 0
    assert boot.reporting == {}  # stock: no counters


def test_uml_series_holds_reporting_while_a_loop_reuses_what_it_freed(lab):
    """A loop allocates again right after each free: no pass reports during
    it, and the loop's last free is reported once the guest goes quiet.

    Before passes were held for the allocator's traffic, the loop's first
    free was reported like a one-shot free and the next iteration faulted
    it back in on the host: 14336 pages of a 16384-page (64 MiB)
    iteration reported during the loop."""
    ctx = lab.context("uml", accel="auto")
    p = churn.ChurnParams(mem_mib=512, churn_mib=64, iterations=6, settle_s=3)
    script = churn.churn_script(p) + "sleep 2\nreporting quiet\n"
    booted = harness.boot(ctx, harness.family("reporting")["freepage"], "t",
                          churn.plan(script, "t", p.mem_mib, 120))
    assert booted is not None
    boot = churn.measure(booted)
    iteration = 64 << 8  # pages
    loop = boot.reporting
    assert loop["reported_pages"] < iteration // 8, loop
    assert loop["held_passes"] > 0, loop
    quiet, _ = churn.reporting_delta(boot.records, "after", "quiet")
    assert quiet["reported_pages"] >= iteration // 2, quiet

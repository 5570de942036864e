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

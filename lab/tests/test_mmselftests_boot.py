"""The mm selftests gate on real guests: the quick set (the hugetlb tests,
hugetlb_fault_after_madv among them, and a few quick ones), stock against
the series with pre-zeroing on, one run each: 258 s under TCG on a quiet
host (2026-11-26), up to about 11 minutes on a busy one
(hugetlb_fault_after_madv alone then takes 140-190 s). `freepage
mm-selftests --quick` runs the other configurations too.

Not in `make test`: with the two kernels it builds (stock and the series
with the selftests' config fragment), a cold run would take `make test`
past its 60 minutes. Run it with `pytest -m gate lab/tests`."""

from __future__ import annotations

import pytest

from freepage_lab import mmselftests

pytestmark = pytest.mark.gate


def test_quick_mm_selftests_pass_on_stock_and_with_prezeroing(lab, capsys):
    ctx = lab.context("qemu", patched=True, extra_fragments=("mm-selftests.config",))
    tests = mmselftests.select(quick=True)
    rc, data, text = mmselftests.run(ctx, 1, tests, ("stock", "prezero"))
    with capsys.disabled():
        print("\n" + text)
    stock, prezero = (next(b for b in data["boots"] if b["config"] == c)
                      for c in ("stock", "prezero"))
    # the suite really ran: every quick test passed on the stock kernel
    assert set(stock["statuses"].values()) == {"pass"}, stock["statuses"]
    # and pre-zeroing was at work meanwhile
    assert prezero["vmstat"].get("pgzero_marked_prezero", 0) > 0, prezero["vmstat"]
    assert not data["regressions"], text
    assert rc == 0

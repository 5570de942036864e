"""The mm selftests gate on real guests: the hugetlb tests and a few quick
ones, stock against the series' three configurations, one run each."""

from __future__ import annotations

import pytest

from freepage_lab import mmselftests

pytestmark = pytest.mark.slow


def test_quick_mm_selftests_pass_on_stock_and_on_the_series(lab, capsys):
    ctx = lab.context("qemu", patched=True, extra_fragments=("mm-selftests.config",))
    tests = mmselftests.select(quick=True)
    rc, data, text = mmselftests.run(ctx, 1, tests, tuple(mmselftests.CONFIGS))
    with capsys.disabled():
        print("\n" + text)
    stock = next(b for b in data["boots"] if b["config"] == "stock")
    # the suite really ran: every quick test passed on the stock kernel
    assert {s for s in stock["statuses"].values()} == {"pass"}, stock["statuses"]
    assert not data["regressions"], text
    assert rc == 0

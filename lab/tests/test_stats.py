import pytest

from freepage_lab import stats


def test_summarise_quartiles():
    s = stats.summarise([1, 2, 3, 4, 5])
    assert (s.n, s.median, s.p25, s.p75, s.min, s.max) == (5, 3, 2, 4, 1, 5)


def test_median_ratio_interval_contains_point():
    a = [10.0, 11, 9, 10, 10.5]
    b = [20.0, 21, 19, 20, 22]
    r = stats.median_ratio(a, b)
    assert r.ratio == pytest.approx(2.0)
    assert r.lo <= r.ratio <= r.hi


def test_median_ratio_needs_samples():
    with pytest.raises(ValueError):
        stats.median_ratio([], [1.0])


def test_small_ratios_keep_two_significant_digits() -> None:
    assert stats.fmt_ratio({"ratio": 0.0031, "lo": 0.0022, "hi": 0.0041}) == "0.0031x [0.0022, 0.0041]"
    assert str(stats.Ratio(0.29, 0.24, 1.0)) == "0.29x [0.24, 1.00]"

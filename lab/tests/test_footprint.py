import json
from pathlib import Path

import pytest

from freepage_lab.footprint import Sample, analyse_reclaim, settle_time, value_at

DATA = Path(__file__).parent / "data"
MIB = 1 << 20


def synthetic():
    # 1 s flat at 600 MiB, freed at t=1, reporting starts at 3 s and drops 100 MiB/s to 100 MiB
    out = []
    t = 0.0
    while t < 15:
        if t < 3:
            v = 600
        else:
            v = max(100, 600 - 100 * (t - 3))
        out.append(Sample(t, int(v * MIB)))
        t += 0.05
    return out


def test_reclaim_times_and_fraction():
    r = analyse_reclaim(synthetic(), 1.0, 512 * MIB)
    assert r.t50_s == pytest.approx(2 + 2.56, abs=0.06)
    assert r.t90_s == pytest.approx(2 + 4.61, abs=0.06)
    assert r.fraction == pytest.approx(500 / 512, abs=0.01)
    assert r.settled_s is not None and r.settled_s == pytest.approx(7.0, abs=0.1)


def test_never_reclaimed_has_no_times():
    flat = [Sample(t / 10, 500 * MIB) for t in range(100)]
    r = analyse_reclaim(flat, 1.0, 256 * MIB)
    assert r.t50_s is None and r.t90_s is None and r.fraction == 0


def test_settle_needs_a_full_window():
    s = [Sample(t / 10, 1) for t in range(10)]
    assert settle_time(s, 0.0, window=3.0) is None


def test_value_at():
    s = [Sample(0, 1), Sample(1, 2), Sample(2, 3)]
    assert value_at(s, 1.5) == 2 and value_at(s, -1) == 1


def test_recorded_qemu_timeline_reanalyses_to_the_saved_result():
    """A real stock-6.12 QEMU run: 4k rounds stall near 80% (per-cpu lists), THP ~100%."""
    data = json.loads((DATA / "reclaim-qemu.json").read_text())
    tl = data["timeline"]
    samples = [Sample(t, int(m * MIB)) for t, m in zip(tl["t_s"], tl["footprint_mib"])]
    rounds = data["rounds"]
    bounds = [0.0, *[r["t_freed_s"] for r in rounds[1:]], float("inf")]
    for i, saved in enumerate(rounds):
        part = [s for s in samples if bounds[i] <= s.t < bounds[i + 1]]
        r = analyse_reclaim(part, saved["t_freed_s"], saved["freed_bytes"])
        assert r.fraction == pytest.approx(saved["fraction"], abs=1e-6)
        assert r.t50_s == pytest.approx(saved["t50_s"])
    thp = [r["fraction"] for r in rounds if r["mode"] == "thp"]
    assert min(thp) >= 0.9


def test_t99_needs_nearly_everything_back():
    r = analyse_reclaim(synthetic(), 1.0, 500 * MIB)
    # 600 -> 100 MiB at 100 MiB/s from t=3: 99% of 500 MiB at 3 + 4.95 s
    assert r.t99_s == pytest.approx(2 + 4.95, abs=0.06)
    assert analyse_reclaim(synthetic(), 1.0, 512 * MIB).t99_s is None

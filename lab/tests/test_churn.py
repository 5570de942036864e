"""churn / pagefault / idle: guest JSON, host /proc parsing, summaries (no boot)."""

import json
from pathlib import Path

import pytest

from freepage_lab import guestshell, harness, procfs
from freepage_lab.initramfs import EVENT
from freepage_lab.scenarios import churn, idle, pagefault
from freepage_lab.shell import LabError

DATA = Path(__file__).parent / "data"


def console_records(name: str) -> list[dict]:
    out = []
    for line in (DATA / name).read_text().splitlines():
        if line.startswith('{"prog":'):
            out.append(json.loads(line))
    return out


def boot(variant: str, records: list[dict], vmm: procfs.Usage | None = None,
         window_s: float = 12.2) -> churn.Boot:
    delta, delay = churn.reporting_delta(records)
    return churn.Boot(variant, records, vmm or procfs.Usage(90000, 6, 24.0),
                      procfs.Usage(0, 0, 0.6), window_s, delta, delay)


def test_proc_stat_counts_reaped_children_and_survives_odd_names():
    # comm with a space and a parenthesis, as /proc allows
    fields = ["S"] + ["0"] * 6 + ["100", "50", "3", "2", "250", "150", "40", "60"] + ["0"] * 30
    text = "4242 (linux (um) x) " + " ".join(fields)
    u = procfs.parse_proc_stat(text, clk_tck=100)
    assert (u.minflt, u.majflt) == (150, 5)
    assert u.cpu_s == pytest.approx(5.0)
    assert (u - procfs.Usage(50, 1, 1.0)).faults == 104


def test_reporting_counters_are_deltas_and_the_delay_is_the_one_after():
    delta, delay = churn.reporting_delta(console_records("churn-uml-console.log"))
    assert delta == {"passes": 3, "time_us": 4000, "reported_pages": 65536,
                     "reused_pages": 40960, "pcp_drained_pages": 20}
    assert delay == 1600
    # stock kernels print no counters
    assert churn.reporting_delta([]) == ({}, None)


def test_churn_boot_is_per_iteration():
    b = churn.churn_boot(boot("freepage", console_records("churn-uml-console.log")))
    assert b.alloc_ms == 4020.0  # median of the three iterations
    assert b.guest_faults == 32768
    assert b.host_faults == pytest.approx(90006 / 3)
    assert b.vmm_cpu_ms == pytest.approx((24.0 + 0.6) * 1000 / 3)
    assert b.loop_s == pytest.approx(12.1914)


def test_churn_boot_without_its_record_fails():
    with pytest.raises(LabError, match="expected one churn record"):
        churn.churn_boot(boot("stock", []))


def _churn_boot(variant: str, alloc: float, host_faults: float) -> churn.ChurnBoot:
    return churn.ChurnBoot(variant, alloc, 32768, host_faults, 100.0, 12.0, [alloc], {}, None)


def test_summary_ratios_are_to_stock_without_off():
    boots = [_churn_boot("stock", a, 40000) for a in (100, 102, 98, 101, 99)]
    boots += [_churn_boot("stock250", a, 60000) for a in (200, 210, 190, 205, 195)]
    s = churn.summarise_churn(boots, churn.VARIANTS)
    assert set(s) == {"stock", "stock250"}  # variants without boots are left out
    assert churn.table_baseline(s) == "stock"
    assert "alloc_ms_ratio_to_off" not in s["stock250"]
    r = s["stock250"]["alloc_ms_ratio_to_stock"]
    assert r["ratio"] == pytest.approx(2.0)
    assert r["lo"] <= 2.0 <= r["hi"]
    assert s["stock250"]["host_faults_ratio_to_stock"]["ratio"] == pytest.approx(1.5)
    assert "alloc_ms_ratio_to_stock" not in s["stock"]
    assert s["stock"]["alloc_ms"]["min"] == 98 and s["stock"]["alloc_ms"]["max"] == 102
    text = churn.churn_table(s)
    assert "2.00x" in text and "stock250" in text


def test_summary_ratios_are_to_off_when_measured():
    boots = [_churn_boot("off", a, 40000) for a in (100, 102, 98, 101, 99)]
    boots += [_churn_boot("stock", a, 40000) for a in (100, 101, 99, 100, 100)]
    boots += [_churn_boot("freepage", a, 50000) for a in (110, 112, 108, 111, 109)]
    s = churn.summarise_churn(boots, churn.VARIANTS)
    assert churn.table_baseline(s) == "off"
    assert s["freepage"]["host_faults_ratio_to_off"]["ratio"] == pytest.approx(1.25)
    assert s["freepage"]["alloc_ms_ratio_to_off"]["ratio"] == pytest.approx(1.10)
    assert s["freepage"]["alloc_ms_ratio_to_stock"]["ratio"] == pytest.approx(1.10)
    assert "alloc_ms_ratio_to_off" not in s["off"]
    text = churn.churn_table(s, "off")
    assert "host faults/off" in text and "1.25x" in text


def test_paired_ratios_and_the_series_without_reporting_as_baseline():
    """Round k of each variant against round k of the baseline; with
    freepage-off measured, a second table is against it."""
    boots = [_churn_boot("off", a, 40000) for a in (100, 300, 100)]
    boots += [_churn_boot("freepage-off", a, 40000) for a in (105, 315, 105)]
    boots += [_churn_boot("freepage", a, 40400) for a in (110, 300, 105)]
    variants = ("off", "freepage-off", "freepage")
    s = churn.summarise_churn(boots, variants)
    paired = s["freepage"]["alloc_ms_paired_to_off"]
    assert (paired["min"], paired["median"], paired["max"]) == pytest.approx((1.0, 1.05, 1.1))
    assert s["freepage"]["alloc_ms_paired_to_freepage-off"]["max"] == pytest.approx(110 / 105)
    assert s["freepage"]["host_faults_paired_to_freepage-off"]["median"] == pytest.approx(1.01)
    assert "freepage-off" not in churn.VARIANTS  # only when asked for
    text = churn.churn_table(s, "freepage-off")
    assert "alloc/freepage-off" in text and "paired 1.00 [0.95-1.05]" in text


def test_rotation_puts_every_variant_first_once():
    firsts = {harness.order(churn.VARIANTS, r, rotate=True)[0] for r in range(4)}
    assert firsts == set(churn.VARIANTS)
    assert sorted(harness.order(churn.VARIANTS, 3, rotate=True)) == sorted(churn.VARIANTS)


def test_scripts_settle_then_mark_the_measured_window():
    s = churn.churn_script(churn.ChurnParams(churn_mib=128, iterations=3, settle_s=7))
    assert s.index("sleep 7") < s.index(f"echo {EVENT} start") < s.index("churn --mib 128")
    assert s.index("churn --mib 128 --iterations 3") < s.index(f"echo {EVENT} done")
    p = pagefault.pagefault_script(pagefault.PagefaultParams(seconds=4))
    assert "pagefault --seconds 4 --mib 128" in p.split(f"echo {EVENT} start")[1]
    i = idle.idle_script(idle.IdleParams(seconds=60))
    window = i.split(f"echo {EVENT} start")[1].split(f"echo {EVENT} done")[0]
    assert window.strip() == "sleep 60"


def test_idle_busy_time_and_percentages():
    recs = [{"prog": "cpustat", "tag": "before", "ticks": [10, 0, 20, 1000, 0, 1, 2, 0]},
            {"prog": "cpustat", "tag": "after", "ticks": [10, 0, 23, 7000, 5, 1, 3, 0]},
            {"prog": "reporting", "tag": "before", "passes": 5, "time_us": 1000,
             "reported_pages": 0, "reused_pages": 0, "pcp_drained_pages": 0,
             "current_delay_ms": 100, "delay_ms": 100},
            {"prog": "reporting", "tag": "after", "passes": 5, "time_us": 1000,
             "reported_pages": 0, "reused_pages": 0, "pcp_drained_pages": 0,
             "current_delay_ms": 100, "delay_ms": 100}]
    # iowait (5 ticks) is idle time, not busy
    assert idle.guest_busy_s(recs) == pytest.approx(0.04)
    b = idle.idle_boot(boot("freepage", recs, procfs.Usage(0, 0, 0.3), window_s=60.0))
    assert b.guest_busy_pct == pytest.approx(0.04 / 60 * 100)
    assert b.reporting_pct == 0.0 and b.passes == 0
    assert b.host_vmm_pct == pytest.approx(0.9 / 60 * 100)
    s = idle.summarise_idle([b], ("off", "freepage"))
    assert list(s) == ["freepage"] and s["freepage"]["passes"]["median"] == 0


def test_pagefault_ratio_to_off():
    recs = [{"prog": "pagefault", "faults_per_s": 9900.0}]
    assert pagefault.faults_per_s(recs) == 9900.0
    s = pagefault.summarise_pagefault({"off": [10000.0, 10100.0, 9900.0],
                                       "freepage": [9900.0, 10000.0, 9800.0]})
    assert s["freepage"]["ratio_to_off"]["ratio"] == pytest.approx(0.99)
    with pytest.raises(LabError):
        pagefault.faults_per_s([])


def test_unknown_variant_is_refused(tmp_path):
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="uml")
    scen = churn.Churn()
    with pytest.raises(LabError, match="unknown variant"):
        scen.run(ctx, scen.params({"variants": "stock,bogus"}))


def test_trace_lines_become_a_timeline():
    recs = [{"prog": "reporting", "tag": "t=12.50", "passes": 9, "current_delay_ms": 400,
             "_t": 1.0},
            {"prog": "reporting", "tag": "before", "passes": 8, "current_delay_ms": 100}]
    assert churn.reporting_trace(recs) == [{"t_s": 12.5, "passes": 9, "current_delay_ms": 400}]
    script = churn.churn_script(churn.ChurnParams(trace_ms=250))
    assert "sleep 0.250; done ) & tracer=$!" in script and "kill $tracer || true" in script
    assert "tracer" not in churn.churn_script(churn.ChurnParams())


def test_a_counter_an_older_series_lacks_is_left_out():
    """The guest prints null for a debugfs file the kernel does not have."""
    script = guestshell.reporting_snapshot()
    assert "held_passes 2>/dev/null || echo null" in script
    recs = [{"prog": "reporting", "tag": "before", "passes": 5, "time_us": 10,
             "reported_pages": 100, "reused_pages": 0, "pcp_drained_pages": 0,
             "held_passes": None, "current_delay_ms": 100, "delay_ms": 100},
            {"prog": "reporting", "tag": "after", "passes": 7, "time_us": 30,
             "reported_pages": 900, "reused_pages": 0, "pcp_drained_pages": 0,
             "held_passes": None, "current_delay_ms": 100, "delay_ms": 100}]
    delta, delay = churn.reporting_delta(recs)
    assert delta == {"passes": 2, "time_us": 20, "reported_pages": 800, "reused_pages": 0,
                     "pcp_drained_pages": 0}
    assert delay == 100


@pytest.mark.parametrize("fragments,variants,uneven", [
    ((), "off,freepage", True),
    (("bench.config",), "off,freepage", False),
    ((), "freepage-off,freepage", False),
], ids=["test-kernel-vs-stock", "bench-kernels", "series-only"])
def test_a_run_says_when_stock_met_the_series_test_kernel(tmp_path, fragments, variants, uneven):
    """Timings of stock against the series' test kernel (debug verifier,
    KUnit) are not the series' cost: such a run says so."""
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True, quiet=True), run_dir=tmp_path, platform="qemu",
                     accel="tcg", extra_fragments=fragments)
    scen = churn.Churn()
    try:
        scen.run(ctx, scen.params({"variants": variants, "repeat": "1"}))
    except LabError:
        pass  # a dry run has no records to summarise; the kernels are what counts
    note = ctx.uneven_kernels()
    assert (note is not None) == uneven, note
    if uneven:
        assert "--fragment bench.config" in note

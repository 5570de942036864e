"""The scale scenario: parameters, guest scripts, parsing, the table; and the
timeouts that grow with a migrating guest's size."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from freepage_lab import harness
from freepage_lab.guest import ConsoleLine
from freepage_lab.guestshell import PREZERO_DIR, ZEROED_STAT
from freepage_lab.initramfs import EVENT
from freepage_lab.runners import check_host_room, host_backing_mib
from freepage_lab.scenarios import get
from freepage_lab.scenarios.migrate import MigrateParams, timeout
from freepage_lab.scenarios.scale import (
    Cost,
    ScaleParams,
    boot_seconds,
    check_params,
    plot,
    prezero_cost,
    prezero_script,
    prezero_stop_at,
    render,
    reporting_costs,
    reporting_script,
    summarise_run,
    target_percent,
    written_mib,
)
from freepage_lab.shell import LabError

GIB_PAGES = 1 << 18


def test_sizes_given_as_text_become_whole_gib() -> None:
    p = get("scale").params({"sizes_gib": "1,8,32"})
    check_params(p, available_mib=20000)
    assert p.sizes_gib == (1, 8, 32)


@pytest.mark.parametrize("sizes, why", [("1,x", "whole GiB"), ("0,8", "at least 1")])
def test_bad_sizes_are_refused(sizes: str, why: str) -> None:
    with pytest.raises(LabError, match=why):
        check_params(get("scale").params({"sizes_gib": sizes}), available_mib=20000)


def test_a_pool_larger_than_half_the_smallest_guest_is_refused() -> None:
    with pytest.raises(LabError, match="pool_mib .* at most half"):
        check_params(ScaleParams(sizes_gib=(1, 8), pool_mib=600), available_mib=20000)


def test_a_guest_whose_memmap_does_not_fit_the_host_is_refused() -> None:
    # 1024 GiB: 16 GiB of struct pages alone, more than a 12 GiB host has
    with pytest.raises(LabError, match="guest.* of up to 1024 GiB need about .* memmap 16384 MiB"):
        check_params(ScaleParams(sizes_gib=(1, 1024)), available_mib=12000)


def test_a_128_gib_guest_needs_its_memmap_and_what_it_writes() -> None:
    # 2 GiB of struct pages, 512 MiB pre-zeroed plus the percent it may
    # overshoot, and the guest's own
    assert written_mib(ScaleParams(), 128) == 512 + 1310
    assert host_backing_mib(128 * 1024, 512 + 1310) == 2048 + 512 + 1310 + 512
    check_params(ScaleParams(sizes_gib=(1, 128)), available_mib=2048 + 512 + 1310 + 512)


@pytest.mark.parametrize("mem_mib, percent", [(1024, 50), (8192, 7), (32768, 2), (131072, 1),
                                              (256, 100)])
def test_target_percent_clears_about_what_is_asked(mem_mib: int, percent: int) -> None:
    assert target_percent(512, mem_mib) == percent


def test_reporting_script_flushes_all_its_memory_then_the_pool() -> None:
    script = reporting_script(ScaleParams(pool_mib=512), 32768)
    assert f"echo {32768 * 256} > /sys/kernel/debug/page_reporting/flush" in script
    lines = script.splitlines()
    boot, pool = lines.index("reporting boot"), lines.index("reporting pool")
    populate = next(i for i, line in enumerate(lines) if line.startswith("populate --mib 512"))
    assert boot < populate < pool


def test_prezero_script_caps_what_it_clears() -> None:
    script = prezero_script(ScaleParams(prezero_mib=512, prezero_wait_s=60), 131072)
    assert "knob target_percent 1" in script and "knob cpu_percent 100" in script
    assert script.index("prezero start") < script.index("knob enabled 1") \
        < script.index("prezero_wait 60") < script.index("prezero end")
    # and stops it itself at 512 MiB (131072 pages), whatever the target does
    assert script.index("knob enabled 1") < script.index("-ge 131072") \
        < script.index("prezero_wait 60")
    unstopped = prezero_script(ScaleParams(prezero_mib=512, prezero_stop=False), 131072)
    assert "-ge 131072" not in unstopped and "knob target_percent 1" in unstopped


def test_the_stop_at_turns_pre_zeroing_off_past_its_share(tmp_path: Path) -> None:
    """The guest's background stop, run by the host's sh against a fake
    enabled file and counter that grows 64 MiB a second."""
    enabled, stat = tmp_path / "enabled", tmp_path / "stat"
    enabled.write_text("1\n")
    stat.write_text("pgzero_marked_prezero 0\n")
    snippet = (prezero_stop_at(128).replace(f"{PREZERO_DIR}/enabled", str(enabled))
               .replace(ZEROED_STAT, str(stat)))
    grow = (f"n=0; while [ \"$(cat {enabled})\" = 1 ] && [ $n -lt 20 ]; do sleep 0.5; "
            f"n=$((n + 1)); echo \"pgzero_marked_prezero $((n * 8192))\" > {stat}; done")
    out = subprocess.run(["sh", "-c", f"{snippet}\n{grow}\nwait"], capture_output=True,
                         text=True, timeout=30)
    assert enabled.read_text().strip() == "0", out
    assert f"{EVENT} prezero stopped at 128 MiB" in out.stdout, out
    # off at 32768 pages, within a second's growth past it
    assert int(stat.read_text().split()[1]) <= 32768 + 2 * 8192, stat.read_text()


def test_the_families_variants_boot_the_series_with_and_without_a_balloon() -> None:
    fam = harness.family("scale")
    assert fam["reporting"].patched and fam["reporting"].balloon and fam["reporting"].reporting
    assert fam["prezero"].patched and not fam["prezero"].balloon


def reporting_records(boot_pages: int, pool_pages: int) -> list[dict]:
    return [{"prog": "reporting", "tag": "boot", "passes": 40, "time_us": 80000,
             "reported_pages": boot_pages},
            {"prog": "reporting", "tag": "pool", "passes": 42, "time_us": 90000,
             "reported_pages": boot_pages + pool_pages}]


def test_reporting_costs_per_phase() -> None:
    boot, pool = reporting_costs(reporting_records(8 * GIB_PAGES, GIB_PAGES // 2), 8, 3.5, 200.0)
    assert (boot.phase, boot.gib, boot.ms, boot.count) == ("boot", 8.0, 80.0, 40)
    assert boot.ms_per_gib == 10.0
    assert (pool.phase, pool.gib, pool.ms, pool.count) == ("pool", 0.5, 10.0, 2)
    assert pool.ms_per_gib == 20.0


def test_a_kernel_without_the_counters_is_an_error() -> None:
    with pytest.raises(LabError, match="reporting counters missing"):
        reporting_costs([], 1, 1.0, 1.0)


def prezero_lines(cleared_pages: int, cpu_ns: int, exact: int = 1) -> list[str]:
    return [f"{EVENT} script uptime_ms 4210",
            f"{EVENT} prezero start cpu_ns 1000 exact {exact} pgzero_marked_prezero 10 "
            "pgzero_prezero_scans 3",
            f"{EVENT} prezero end cpu_ns {1000 + cpu_ns} exact {exact} pgzero_marked_prezero "
            f"{10 + cleared_pages} pgzero_prezero_scans 9"]


def test_prezero_cost_from_its_two_lines() -> None:
    lines = prezero_lines(GIB_PAGES // 2, 150_000_000)
    console = [ConsoleLine(100.0 + i, text) for i, text in enumerate(lines)]
    cost = prezero_cost(lines, 32, boot_seconds(console, 96.5), 600.0)
    assert (cost.gib, cost.ms, cost.count, cost.boot_s) == (0.5, 150.0, 6, 3.5)
    assert cost.ms_per_gib == 300.0 and cost.exact


def test_a_guest_that_never_started_its_script_is_an_error() -> None:
    with pytest.raises(LabError, match="never said when its script started"):
        boot_seconds([ConsoleLine(1.0, "Linux version 6.12")], 0.0)


def test_prezero_cost_without_its_end_line_is_an_error() -> None:
    with pytest.raises(LabError, match="start or end line is missing"):
        prezero_cost(prezero_lines(1, 1)[:2], 1, 1.0, 1.0)


def test_summary_table_and_growth_over_the_smallest_guest(tmp_path: Path) -> None:
    p = ScaleParams(sizes_gib=(1, 8))
    costs = []
    for size, ms in ((1, 10.0), (8, 30.0)):
        for rep in range(3):
            costs += [Cost(size, "reporting", "boot", size, ms * size + rep, 5, 2.0 * size, 100.0),
                      Cost(size, "reporting", "pool", 0.5, 5.0, 2, 2.0 * size, 100.0),
                      Cost(size, "prezero", "clear", 0.5, 100.0, 4, 2.0 * size, 600.0,
                           exact=False)]
    data = summarise_run(p, costs)
    boot8 = data["sizes"]["8"]["reporting/boot"]
    assert boot8["ms_per_gib"]["median"] == pytest.approx(30.125)
    assert boot8["growth"] == pytest.approx(30.125 / 11.0)
    assert data["sizes"]["8"]["prezero/clear"]["growth"] == pytest.approx(1.0)
    text = render(data)
    assert "reporting  boot   30.1 [30.1-30.2]" in text
    assert "prezero    clear  200.0 [200.0-200.0] *" in text
    png = tmp_path / "scale.png"
    plot(data, png)
    assert png.stat().st_size > 0


def test_migrate_timeouts_grow_with_the_guest() -> None:
    assert timeout(MigrateParams()) == 180 + 8
    assert timeout(MigrateParams(mem_mib=128 * 1024)) == 180 + 8 * 128
    assert timeout(MigrateParams(mem_mib=128 * 1024, timeout_s_per_gib=0)) == 180


def test_both_ends_of_a_128_gib_migration_must_fit_the_host() -> None:
    ends = [(128 * 1024, 700)] * 2
    check_host_room("migrate", ends, available_mib=2 * (2048 + 700 + 512))
    with pytest.raises(LabError, match=r"migrate: 2 guest\(s\) of up to 128 GiB need about 6520"):
        check_host_room("migrate", ends, available_mib=6000)


def test_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path: Path) -> None:
    from freepage_lab.context import new_run_dir

    first = new_run_dir(tmp_path / "runs" / "20261130-074235-migrate-qemu-debian")
    second = new_run_dir(tmp_path / "runs" / "20261130-074235-migrate-qemu-debian")
    assert first.name == "20261130-074235-migrate-qemu-debian"
    assert second.name == "20261130-074235-migrate-qemu-debian-2"
    assert first.is_dir() and second.is_dir()

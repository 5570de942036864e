"""reclaim's variants: boot order, guest script, summaries, kernels (no boot)."""

from pathlib import Path

import pytest

from freepage_lab import cli, demo, harness, kernel
from freepage_lab.guestshell import REPORTING_ORDER
from freepage_lab.scenarios import reclaim
from freepage_lab.shell import LabError, Shell


def test_boots_interleave_and_rotate():
    order = [v for r in range(3) for v in harness.order("abc", r, rotate=True)]
    assert order == list("abc" "bca" "cab")
    assert [v for r in range(3) for v in harness.order("abc", r)] == list("abc" "cba" "abc")


def test_guest_script_marks_populate_and_free_and_reads_the_counters():
    p = reclaim.ReclaimParams(modes=("4k", "thp"), rounds=2, settle_s=7)
    script = reclaim.guest_script(p)
    assert script.count("populate --mib 512") == 4
    assert "FREEPAGE-EVENT populate 3" in script and "FREEPAGE-EVENT freed 3" in script
    assert "sleep 7" in script
    # default per-cpu lists unless asked
    assert "percpu_pagelist_high_fraction" not in script
    assert "percpu_pagelist_high_fraction" in reclaim.guest_script(
        reclaim.ReclaimParams(pcp_high_fraction=1000))
    assert "/sys/kernel/debug/page_reporting/$f" in script


def test_counters_parse_scalars_and_per_order_lists():
    lines = ["REPORTING-COUNTER passes 12", "noise",
             "REPORTING-COUNTER reported_pages 0 0 0 0 0 0 0 0 0 131072 0",
             "REPORTING-COUNTER pcp_drained_pages 65536"]
    c = reclaim.parse_counters(lines)
    assert c["passes"] == 12 and c["pcp_drained_pages"] == 65536
    assert c["reported_pages"] == [0] * 9 + [131072, 0]
    assert reclaim.parse_counters(["no counters on a stock kernel"]) == {}


def _round(t50, t90, t99, frac, mode="4k"):
    mib = 1 << 20
    return {"t50_s": t50, "t90_s": t90, "t99_s": t99, "fraction": frac, "mode": mode,
            "before_bytes": 600 * mib, "after_bytes": int((600 - 512 * frac) * mib)}


def test_summary_ranks_never_above_every_time_and_judges_the_goals():
    rounds = [_round(0.2, 0.5, 1.5, 1.0), _round(0.3, 0.8, None, 0.98),
              _round(0.25, 1.2, 1.9, 0.995)]
    s = reclaim.summarise(rounds)
    assert s["t90_s"] == {"median": 0.8, "min": 0.5, "max": 1.2, "n": 3, "reached": 3}
    assert s["t99_s"]["median"] == 1.9 and s["t99_s"]["max"] is None
    assert s["t90_within_1s"] == {"met": True, "rounds": 2, "of": 3}
    assert s["t99_within_2s"] == {"met": True, "rounds": 2, "of": 3}
    never = reclaim.summarise([_round(None, None, None, 0.1)] * 2)
    assert never["t90_s"]["median"] is None and not never["t90_within_1s"]["met"]
    text = reclaim.release_table({"stock": {"4k": never}, "freepage": {"4k": s}}, ("4k",))
    assert "never [never-never]" in text and "0.80 [0.50-1.20]" in text
    assert "yes (2/3)" in text and "no (0/2)" in text


def test_unknown_variant_is_refused(tmp_path):
    from freepage_lab.context import RunContext

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="uml")
    scen = reclaim.ReclaimScenario()
    with pytest.raises(LabError, match="unknown variant 'nope'"):
        scen.run(ctx, scen.params({"variants": "stock,nope"}))


def test_stock250_is_pristine_6_12_plus_the_bench_patch(capsys):
    patch = kernel.QUEUES["never-zero-twice"].bench_dir / harness.STOCK250_PATCH
    assert "#define PAGE_REPORTING_DELAY\tmsecs_to_jiffies(250)" in patch.read_text()
    plain = kernel.BuildSpec("um", patched=False)
    spec = kernel.BuildSpec("um", patched=False, extra_patches=(harness.STOCK250_PATCH,))
    assert spec.label == "um-release-vanilla+stock-delay-250ms"
    shell = Shell(dry_run=True)
    built = kernel.build(shell, spec)
    assert built.out_dir.parent != kernel.build(shell, plain).out_dir.parent
    applied = [ln for ln in capsys.readouterr().err.splitlines()
               if ln.startswith("$ patch ") and "/kernel/platform/" not in ln]
    # only the bench patch (after the platform's): none of the series
    assert len(applied) == 1 and applied[0].endswith("bench/stock-delay-250ms.patch")


def test_dry_run_shows_each_variant_on_the_same_host_side(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "reclaim", "--platform", "qemu", "--accel", "tcg"]) == 0
    qemus = [ln for ln in capsys.readouterr().err.splitlines() if "-machine pc" in ln]
    assert len(qemus) == 4 and all(q.startswith("$ qemu-system-x86_64 ") for q in qemus)
    # QEMU's default, said as the published figures' commands said it
    assert "free-page-reporting=off" in qemus[0]
    assert all("free-page-reporting=on" in q for q in qemus[1:])
    assert ["vanilla-" in qemus[1], "vanilla+stock-delay-250ms" in qemus[2],
            "patched" in qemus[3]] == [True] * 3
    assert not any("device-init" in q for q in qemus)
    assert cli.main(["--dry-run", "run", "reclaim", "--platform", "uml"]) == 0
    daemons = [ln for ln in capsys.readouterr().err.splitlines() if "--socket-path" in ln]
    assert len(daemons) == 4 and "--no-reporting" in daemons[0]
    assert not any("--no-reporting" in d for d in daemons[1:])
    # the same device for every variant: the daemon offering bits 6 and 7
    # (bit 6 goes with the reporting queue), as the published figures were
    # measured
    assert all("--x-device-init-on-inflate" in d for d in daemons)
    assert all("--x-device-init-reported" in d for d in daemons[1:])


def test_demo_reclaim_steps_compare_variants_with_default_pcp_lists():
    steps = [s for s in demo.STEPS if s.scenario == "reclaim"]
    assert {s.platform for s in steps} == {"uml", "qemu"}
    for s in steps:
        assert s.kind == "own"
        assert "pcp_high_fraction" not in s.params and "pcp_high_fraction" not in s.quick
        assert s.quick["variants"] == "stock,freepage"



def _populate_and_free(base_mib, populated_mib, end_mib):
    """Footprint samples at 50 Hz: `base_mib` until the populate at 0.5 s,
    `populated_mib` until the free at 2 s, then 100 MiB/s down to `end_mib`."""
    mib = 1 << 20
    out = []
    for k in range(600):
        t = k * 0.02
        v = base_mib if t < 0.5 else populated_mib if t < 2 else max(
            end_mib, populated_mib - 1000 * (t - 2))
        out.append(reclaim.Sample(t, int(v * mib)))
    return out


def test_round_is_measured_against_what_the_populate_added():
    # 512 MiB populated, 10 MiB of it backed already: the footprint grows by
    # 502 MiB, and the free takes it back to 3 MiB below where it started
    samples = _populate_and_free(60, 562, 57)
    r = reclaim.analyse_round(samples, reclaim.value_at(samples, 0.45), 2.0, 512 << 20)
    assert r["added_bytes"] == 502 << 20
    assert r["fraction"] == pytest.approx(505 / 502)
    assert r["fraction_of_freed"] == pytest.approx(505 / 512)
    assert r["t99_s"] == pytest.approx(0.50, abs=0.03)  # 99% of 502 MiB at 1000 MiB/s
    assert r["t99_of_freed_s"] is None  # 99% of 512 MiB is never reached
    assert r["left_behind_mib"] == pytest.approx(-3)
    kept = reclaim.analyse_round(_populate_and_free(60, 562, 70), 60 << 20, 2.0, 512 << 20)
    assert kept["left_behind_mib"] == pytest.approx(10) and kept["t99_s"] is None


# recorded: UML, the series, 512 MiB populated and freed, then a report of
# every free block from order 0 (reclaim --param probe_order=0)
MEMSTATE_BEFORE = {"prog": "memstate", "tag": "before 0",
                   "free_blocks": [0, 1, 1, 2, 0, 1, 2, 2, 4, 4, 494], "pcp_pages": 361,
                   "memfree_kib": 2037464, "reporting_order": 10}
MEMSTATE_SETTLED = {"prog": "memstate", "tag": "settled 0",
                    "free_blocks": [3, 2, 2, 0, 7, 3, 5, 5, 6, 4, 493], "pcp_pages": 126,
                    "memfree_kib": 2038396, "reporting_order": 10}


def test_memstate_change_splits_free_memory_at_the_reporting_order():
    c = reclaim.memstate_change(MEMSTATE_BEFORE, MEMSTATE_SETTLED)
    page_mib = 4096 / (1 << 20)
    assert c["guest_free_below_order_settled_mib"] == pytest.approx(4767 * page_mib)
    assert c["guest_free_below_order_mib"] == pytest.approx((4767 - 3510) * page_mib)
    assert c["guest_free_at_order_mib"] == pytest.approx(-4.0)
    assert c["guest_pcp_mib"] == pytest.approx(-235 * page_mib)
    assert c["guest_memfree_mib"] == pytest.approx(932 / 1024)
    assert reclaim.memstate_change(None, MEMSTATE_SETTLED) == {}
    # no reporting device (order -1): the largest order stands in
    off = reclaim.memstate_change(MEMSTATE_BEFORE | {"reporting_order": -1},
                                  MEMSTATE_SETTLED | {"reporting_order": -1})
    assert off["reporting_order"] == 10 and off["guest_free_at_order_mib"] == pytest.approx(-4.0)


def test_memstate_function_prints_one_json_line(tmp_path):
    import json
    import shutil
    import subprocess

    if not shutil.which("awk") or not Path("/proc/buddyinfo").exists():
        pytest.skip("needs awk and /proc/buddyinfo")
    out = subprocess.run(["sh", "-c", reclaim.memstate_function() + "\nmemstate 'before 0'"],
                         capture_output=True, text=True, check=True).stdout
    rec = json.loads(out)
    assert rec["prog"] == "memstate" and rec["tag"] == "before 0"
    assert len(rec["free_blocks"]) >= 11 and rec["memfree_kib"] > 0


def test_probe_reports_smaller_blocks_after_the_settle_and_restores_the_order():
    assert "probe" not in reclaim.guest_script(reclaim.ReclaimParams(modes=("4k",)))
    script = reclaim.guest_script(reclaim.ReclaimParams(modes=("4k",), probe_order=0))
    assert (script.index("memstate 'settled 0'") < script.index("FREEPAGE-EVENT probe 0")
            < script.index(f"echo 0 > {REPORTING_ORDER}")
            < script.index(f"echo $o > {REPORTING_ORDER}")
            < script.index("FREEPAGE-EVENT probed 0"))
    # stock kernels have no flush: the probe only waits
    assert "else sleep 2; fi" in reclaim.probe_below_order(0)


def test_guest_table_shows_where_the_free_memory_went():
    rounds = [_round(0.2, 0.3, 0.4, 1.01) | {"left_behind_mib": -3.0}
              | reclaim.memstate_change(MEMSTATE_BEFORE, MEMSTATE_SETTLED)
              | {"probe_released_mib": 13.0}]
    s = reclaim.summarise(rounds)
    text = reclaim.guest_table({"freepage": {"4k": s}}, ("4k",))
    assert "13.0 [13.0-13.0]" in text and "18.6 [18.6-18.6]" in text
    assert reclaim.guest_table({"freepage": {"4k": reclaim.summarise([_round(1, 1, 1, 1)])}},
                               ("4k",)) == ""


def test_trace_samples_the_counters_through_the_boot_and_stops_before_the_end():
    assert "tracer" not in reclaim.guest_script(reclaim.ReclaimParams(modes=("4k",)))
    script = reclaim.guest_script(reclaim.ReclaimParams(modes=("4k",), trace_ms=200))
    assert "reporting() {" in script and "sleep 0.200" in script
    assert (script.index("tracer=$!") < script.index("FREEPAGE-EVENT populate 0")
            < script.index("kill $tracer") < script.index("REPORTING-COUNTER"))

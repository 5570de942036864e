"""reclaim's variants: boot order, guest script, summaries, kernels (no boot)."""

import pytest

from freepage_lab import cli, demo, harness, kernel
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
    applied = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("$ patch ")]
    # only the bench patch: none of the series
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


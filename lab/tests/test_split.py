"""split scenario: guest script, parsing the stats and the selftest's lines, the table."""

import json

import pytest

from freepage_lab import scenarios
from freepage_lab.scenarios import split
from freepage_lab.shell import LabError


def rec(backing="anonymous", manual="-g", ns=1000, visits=(1, 1, 128, 65536), enable="0.5",
        clear="", rc=0, calls=128, breaks=0):
    stats = f"calls {calls} ns {ns} visits {' '.join(str(v) for v in visits)} breaks {breaks}"
    return {"prog": "split", "backing": backing, "manual": manual, "rc": rc,
            "enable_s": enable, "clear_s": clear, "stats": stats}


def test_guest_script_runs_every_case_with_eager_split_on():
    p = split.Params(backings=("anonymous", "anonymous_hugetlb"), manual=("off", "on"), mib=64)
    text = split.guest_script(p)
    assert "/kvm/dirty_log_perf_test -S 2097152 -m 6 -v 1" in text
    assert "-b 64M -i 2" in text
    assert "run_case anonymous -g\n" in text and "run_case anonymous\n" in text
    assert "run_case anonymous_hugetlb -g\n" in text
    assert "echo 40 > /proc/sys/vm/nr_hugepages" in text  # mib/2 + 8 spare


def test_guest_script_json_line_is_valid_json_once_the_shell_fills_it_in():
    text = split.guest_script(split.Params())
    first = text[text.index("printf '{"):]
    fmt = first.split("'")[1] + text[text.index("printf '\"clear_s"):].split("'")[1]
    line = fmt.replace("%s", "x").replace("%d", "0").replace("\\n", "")
    assert json.loads(line)["prog"] == "split"


def test_parse_stats_and_seconds():
    assert split.parse_stats("calls 3 ns 120 visits 1 2 3 4\n") == {
        "split_calls": 3, "split_insns": 120, "visits_by_level": [1, 2, 3, 4]}
    assert split.parse_stats("calls 3 ns 120 visits 1 2 3 4 breaks 512\n")["split_faults"] == 512
    with pytest.raises(LabError, match="unexpected"):
        split.parse_stats("garbage")
    assert split.seconds_to_insns("1.000000250") == 1_000_000_250
    assert split.seconds_to_insns("0.5") == 500_000_000
    assert split.seconds_to_insns("") is None


def test_parse_record_names_the_manual_mode_and_fails_on_a_failed_test():
    r = split.parse_record(rec())
    assert r["manual"] == "off" and r["enable_ioctl_insns"] == 500_000_000
    assert split.parse_record(rec(manual="manual"))["manual"] == "on"
    with pytest.raises(LabError, match="exit 1"):
        split.parse_record(rec(rc=1))


def test_summary_ratio_and_table():
    samples = {
        "stock": [split.parse_record(rec(ns=1000)), split.parse_record(rec(ns=1010))],
        "series": [split.parse_record(rec(ns=500, visits=(1, 1, 128, 0))),
                   split.parse_record(rec(ns=505, visits=(1, 1, 128, 0)))],
    }
    [case] = split.summarise_cases(samples)
    assert case["ratio_split_insns"]["ratio"] == pytest.approx(0.5, rel=0.01)
    assert case["series"]["visits_by_level"] == [1, 1, 128, 0]
    assert case["stock"]["visits_identical_across_rounds"]
    out = split.render([case])
    assert "1/1/128/65536" in out and "1/1/128/0" in out and "-50.0%" in out
    assert case["series"]["split_faults"] == [0, 0]
    samples["stock"][1]["split_faults"] = 3
    assert " 0/3 " in split.render(split.summarise_cases(samples))


def test_split_refuses_other_platforms_and_bad_params(tmp_path):
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="qemu")
    with pytest.raises(LabError, match="split runs on arm64"):
        scenarios.run(split.Split(), ctx, split.Params())
    ctx.platform = "arm64"
    with pytest.raises(LabError, match="unknown backing"):
        split.Split().run(ctx, split.Split().params({"backings": "shmem"}))


def test_dry_run_split_prints_both_kernels_and_icount_boots(capsys, tmp_path, monkeypatch):
    from freepage_lab import cli

    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    assert cli.main(["--dry-run", "run", "split", "--platform", "arm64",
                     "--param", "rounds=1"]) == 0
    err = capsys.readouterr().err
    assert err.count("split-walk-stats.patch") >= 2  # stock and series carry it
    assert "arm64-split/patches/0002" in err  # the series
    assert err.count("$ qemu-system-aarch64") == 2 and "-icount shift=0" in err
    assert not (tmp_path / "runs").exists()


def test_1g_hugetlb_needs_whole_gib(tmp_path):
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="arm64")
    scen = split.Split()
    with pytest.raises(LabError, match="multiple of 1024"):
        scen.run(ctx, scen.params({"backings": "anonymous_hugetlb_1gb", "mib": "512"}))


def recorded(name):
    """The split records of a recorded console (lab/tests/data), as Guest.json_records gives."""
    from pathlib import Path

    text = (Path(__file__).parent / "data" / name).read_text()
    recs = []
    for line in text.splitlines():
        body = line.split("] ", 1)[-1]
        if body.startswith('{"prog":"split"'):
            recs.append(json.loads(body))
    return recs


def test_recorded_1gib_run_every_level3_visit_gone():
    samples = {v: [split.parse_record(r) for r in recorded(f"split-arm64-{v}.log")]
               for v in ("stock", "series")}
    assert len(samples["stock"]) == len(samples["series"]) == 6
    cases = {(c["backing"], c["manual"]): c for c in split.summarise_cases(samples)}
    anon = cases[("anonymous", "off")]
    assert anon["stock"]["visits_by_level"] == [0, 513, 513, 262144]
    assert anon["series"]["visits_by_level"] == [0, 513, 513, 0]
    assert anon["stock"]["enable_ioctl_insns_median"] == 80_921_936
    assert anon["ratio_split_insns"]["ratio"] == pytest.approx(0.0107, abs=0.001)
    thp = cases[("anonymous_thp", "on")]
    assert thp["stock"]["clear_ioctls_insns_median"] == 332_130_738
    assert thp["ratio_split_insns"]["ratio"] == pytest.approx(0.728, abs=0.002)
    for c in cases.values():
        assert c["series"]["visits_by_level"][3] == 0
        assert c["series"]["visits_by_level"][:3] == c["stock"]["visits_by_level"][:3]


def test_guest_page_size_picks_the_selftest_mode():
    assert "-m 8 -v 1" in split.guest_script(split.Params(guest_page_kib=64))
    assert "-m 6 -v 1" in split.guest_script(split.Params())


def test_ioctl_net_of_the_visit_counting():
    def case(variant_ns, visits, manual):
        return split.parse_record(rec(backing="anonymous_thp", manual=manual, visits=visits,
                                      enable=variant_ns, clear=variant_ns))
    stock = case("0.100000000", (0, 1, 512, 262144), "-g")
    series = case("0.050000000", (0, 1, 512, 0), "-g")
    # 7 instructions per counted last-level visit, 8 above, 103 per timed call
    assert stock["stats_overhead_insns"] == 8 * 513 + 7 * 262144 + 103 * 128
    assert stock["ioctl_net_insns"] == 100_000_000 - stock["stats_overhead_insns"]
    assert series["ioctl_net_insns"] == 50_000_000 - 8 * 513 - 103 * 128
    [c] = split.summarise_cases({"stock": [stock], "series": [series]})
    out = split.render_ioctls([c])
    assert "enable (manual off)" in out and "-49.1%" in out
    # the document's figure is another change (the walk skip alone, hardware time)
    assert "-24.7%" not in out and "yes" not in out
    on = split.parse_record(rec(manual="manual", visits=(0, 1, 1, 0), enable="", clear="1.0",
                                calls=1))
    assert on["ioctl_net_insns"] == 1_000_000_000 - 16 - 103


def test_a_kernel_that_makes_no_split_call_is_not_credited_with_the_timing_of_one():
    # stock times 9216 split calls at clear, a kernel that skips them none:
    # what the timing costs comes off stock's figure, nothing off the other's
    stock = split.parse_record(rec(manual="manual", visits=(0, 9216, 9216, 0), enable="",
                                   clear="0.083000000", calls=9216))
    skipped = split.parse_record(rec(manual="manual", visits=(0, 0, 0, 0), enable="",
                                     clear="0.050000000", calls=0))
    assert stock["ioctl_net_insns"] == 83_000_000 - 8 * 2 * 9216 - 103 * 9216
    assert skipped["ioctl_net_insns"] == 50_000_000


def test_bad_guest_page_size_is_refused(tmp_path):
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="arm64")
    with pytest.raises(LabError, match="guest_page_kib"):
        split.Split().run(ctx, split.Split().params({"guest_page_kib": "8"}))


def test_step_table_puts_the_document_beside_patches_1_to_3():
    def thp(variant_s, breaks=0):
        return split.parse_record(rec(backing="anonymous_thp", visits=(0, 0, 0, 0), calls=0,
                                      enable=variant_s, breaks=breaks))
    samples = {"stock": [thp("0.100000000")], "p1-3": [thp("0.080000000")],
               "p1-4": [thp("0.010000000", breaks=2)], "series": [thp("0.005000000")]}
    out = split.render_steps(split.summarise_cases(samples))
    head, row = out.splitlines()[0].split(), out.splitlines()[2]
    assert head[3:6] == ["p1-3", "document", "(hw"]  # the document right after patches 1-3
    assert "80.00 (-20.0%)  -24.7%" in row and "5.00 (-95.0%)" in row
    assert "p1-5" not in head  # a step not run has no column
    # split faults of every kernel, in the order of the steps
    assert head[-2:] == ["faults", "stock/p1-3/p1-4/series"] and row.rstrip().endswith("0 / 0 / 2 / 0")
    assert "not time" in out


def test_split_steps_are_prefixes_of_the_series(tmp_path):
    from freepage_lab import harness, kernel

    fam = harness.family("split")
    assert [fam[v].series_patches for v in split.STEPS] == [3, 4, 5, 0]
    with pytest.raises(LabError, match="for a patched kernel"):
        kernel.BuildSpec("arm64", patched=False, series_patches=3)
    assert kernel.BuildSpec("arm64", series_patches=3).label == "arm64-release-patched3"
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="arm64")
    with pytest.raises(LabError, match="include stock"):
        split.Split().run(ctx, split.Split().params({"variants": "series"}))

"""freepage demo: the plan and the side-by-side table (no boot)."""

import re

from freepage_lab import cli, demo


def test_side_by_side_pairs_medians_and_ratios():
    stock = {"modes": {"thp": {"t90_s": {"median": 4.0, "n": 5}}, "4k": {"t90_s": {"median": 0}}}}
    free = {"modes": {"thp": {"t90_s": {"median": 1.0, "n": 5}}, "4k": {"t90_s": {"median": 2}}}}
    text = demo.side_by_side(stock, free)
    assert "modes.thp.t90_s" in text and "0.25x" in text
    assert "n/a" in text  # a zero stock median has no ratio
    assert demo.side_by_side({"a": 1}, {"b": 2}) == "(no common medians)"
    # reclaim keeps its medians one level deeper, per mode
    nested = demo.side_by_side({"median": {"4k": {"t50_s": 2.0}}}, {"median": {"4k": {"t50_s": 1.0}}})
    assert "median.4k.t50_s" in nested and "0.50x" in nested


def test_every_step_names_a_scenario_and_valid_parameters():
    for step in demo.STEPS:
        scenario = cli.scenarios.get(step.scenario)
        scenario.params(step.params)
        scenario.params(step.quick)
        assert step.kind in ("ab", "own")


def test_quick_dry_run_shows_both_sides(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "demo", "--quick", "--accel", "tcg"]) == 0
    err = capsys.readouterr().err
    qemus = [ln for ln in err.splitlines() if "-machine pc,accel=tcg" in ln]
    # stock: Debian's QEMU and the stock kernel; freepage: patched QEMU and the series
    assert any(q.startswith("$ qemu-system-x86_64 ") and "vanilla" in q for q in qemus)
    assert any("x-device-init-reported=on" in q and "patched" in q for q in qemus)
    assert not (tmp_path / "runs").exists()


def test_no_zeroing_bit_without_the_reporting_queue(tmp_path):
    """QEMU refuses x-device-init-reported on a balloon without free page
    reporting (realloc's 'backed' guests)."""
    from freepage_lab import harness
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, accel="tcg", patched=True,
                     patched_qemu=True)
    backed = harness.family("realloc")["backed"]
    cfg = harness.guest_config(ctx, backed, "backed", harness.Plan("true\n"))
    argv = " ".join(harness.runner(ctx, backed).argv(cfg))
    assert "device-init-reported" not in argv and "x-device-init-on-inflate=on" in argv


def test_a_failed_step_says_why_and_the_demo_goes_on(capsys, tmp_path, monkeypatch):
    """A host on which one platform cannot boot still gets every other table."""
    from freepage_lab.shell import LabError

    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))

    def run_step(step, stock, freepage, quick):
        if step.scenario == "zerofirst":
            raise LabError("test-uml: guest kernel failed (Kernel panic)\n  cause: the host ...")
        if step.scenario == "split":
            raise RuntimeError("no arm64 busybox")
        return f"table of {step.scenario}"

    monkeypatch.setattr(demo, "run_step", run_step)
    assert cli.main(["demo", "--quick", "--accel", "tcg"]) == 1
    out = capsys.readouterr().out
    ran = [s for s in demo.STEPS if s.scenario not in ("zerofirst", "split")]
    assert all(f"table of {s.scenario}" in out for s in ran)
    assert "step failed: test-uml: guest kernel failed (Kernel panic)" in out
    total = out[out.index("== summary =="):]
    rows = {" ".join(ln.split()[:3]): " ".join(ln.split()[3:]) for ln in total.splitlines()}
    assert rows["zerofirst on uml"] == "failed test-uml: guest kernel failed (Kernel panic)"
    assert rows["split on arm64"] == "failed RuntimeError: no arm64 busybox"
    assert rows["reclaim on qemu"] == "ok"
    assert f"{len(ran)} of {len(demo.STEPS)} steps ran, 2 failed" in total
    [run] = (tmp_path / "runs").iterdir()
    assert "2 failed" in (run / "summary.txt").read_text()
    # the figures say which CPU they come from
    assert "xstate_bytes" in (run / "host.json").read_text()


def test_the_split_step_measures_the_kernels_of_freepage_run_split(capsys, tmp_path, monkeypatch):
    """Its kernels carry the scenario's own -O2 fragment only, so the demo
    boots the kernels `freepage run split` measured (no second set built with
    bench.config), every step of the series among them."""
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "demo", "--quick", "--only", "split"]) == 0
    builds = [ln for ln in capsys.readouterr().err.splitlines()
              if ln.startswith("$ make ") and ln.endswith(" olddefconfig")]
    labels = sorted({re.search(r"O=\S*/(arm64-\S+)-[0-9a-f]{16} ", ln).group(1) for ln in builds})
    assert labels == [f"arm64-release-{k}+arm64-split-bench+split-walk-stats"
                      for k in ("patched", "patched3", "patched4", "patched5", "vanilla")]

import pytest

from freepage_lab import cli, kernel, paths
from freepage_lab.shell import LabError, Shell


@pytest.mark.parametrize("scenario,extra", [
    ("reclaim", []), ("realloc", []), ("migrate", []),
    ("zeroskip", []),
])
def test_dry_run_prints_the_commands_and_runs_nothing(scenario, extra, capsys, tmp_path,
                                                      monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", scenario, "--vanilla", "--accel", "tcg", *extra]) == 0
    err = capsys.readouterr().err
    assert "$ make -C" in err and "tinyconfig" in err
    assert "$ qemu-system-x86_64 -machine pc,accel=tcg" in err
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def lab_dirs(tmp_path, monkeypatch):
    """Runs and the build cache under the test's own directory."""
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))


def test_unknown_parameter_is_a_clear_error(capsys):
    assert cli.main(["--dry-run", "run", "reclaim", "--param", "nope=1"]) == 1
    assert "unknown parameter 'nope'" in capsys.readouterr().err


def test_bad_parameter_value(capsys):
    assert cli.main(["--dry-run", "run", "reclaim", "--param", "repeat=many"]) == 1
    assert "bad value 'many' for repeat" in capsys.readouterr().err


def test_missing_program_names_the_fix():
    with pytest.raises(LabError, match="command not found: freepage-no-such-tool.*make deps"):
        Shell(quiet=True).run(["freepage-no-such-tool"])


def test_medians_flattens_result_trees():
    tree = {"realloc": {"modes": {"thp": {"populate_ms": {"backed": {"median": 2.0, "n": 5}}}}},
            "reclaim": {"median": {"t50_s": 1.5, "t90_s": None}}}
    assert cli.medians(tree) == {"realloc.modes.thp.populate_ms.backed.median": 2.0,
                                 "reclaim.median.t50_s": 1.5}


def test_dry_run_with_patched_qemu_builds_it_and_runs_it(capsys, tmp_path, lab_dirs):
    assert cli.main(["--dry-run", "boot", "--vanilla", "--accel", "tcg", "--patched-qemu"]) == 0
    err = capsys.readouterr().err
    assert "configure --target-list=x86_64-softmmu" in err
    built = [ln for ln in err.splitlines() if ln.startswith("$ ") and "/qemu-system-x86_64 " in ln]
    assert built and "-L /usr/share/seabios" in built[0]
    assert not (tmp_path / "cache" / "qemu").exists()


def test_boot_icount_counts_guest_time_in_instructions(capsys, lab_dirs):
    assert cli.main(["--dry-run", "boot", "--platform", "qemu", "--accel", "tcg",
                     "--icount"]) == 0
    started = [ln for ln in capsys.readouterr().err.splitlines()
               if ln.startswith("$ ") and "qemu-system-x86_64 " in ln]
    assert started and "-icount shift=0" in started[-1]
    assert cli.main(["--dry-run", "boot", "--platform", "uml", "--icount"]) != 0
    assert "boot --icount: guest instruction counts need QEMU, not uml" in capsys.readouterr().err


def test_irqsoff_fragment_applies_to_the_stock_kernel_too(capsys, lab_dirs):
    assert cli.main(["--dry-run", "boot", "--vanilla", "--platform", "qemu", "--accel", "tcg",
                     "--fragment", "irqsoff.config"]) == 0
    merged = [ln for ln in capsys.readouterr().err.splitlines() if "merge_config.sh" in ln]
    assert merged and "x86_64-release-vanilla+irqsoff" in merged[0]
    assert "kernel/configs/irqsoff.config" in merged[0]


def test_64k_pages_fragment_replaces_the_4k_choice_on_both_kernels(capsys, lab_dirs):
    """A page size is the platform's, not the series': stock gets it too, and
    it comes after arm64.config, whose 4 KiB choice it turns off."""
    for vanilla in (["--vanilla"], []):
        assert cli.main(["--dry-run", "boot", *vanilla, "--platform", "arm64",
                         "--fragment", "arm64-64k.config"]) == 0
        [merged] = [ln for ln in capsys.readouterr().err.splitlines() if "merge_config.sh" in ln]
        assert merged.index("configs/arm64.config") < merged.index("configs/arm64-64k.config")
    frag = kernel.parse_fragment((paths.CONFIG_DIR / "arm64-64k.config").read_text())
    assert frag == {"CONFIG_ARM64_4K_PAGES": "n", "CONFIG_ARM64_64K_PAGES": "y"}


def test_series_check_qemu_checks_every_qemu_series(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(cli.qemu, "check", lambda shell, queue: calls.append(queue.name)
                        or cli.StageResult(f"check {queue.name}", "ok", 0.0))
    assert cli.main(["series", "check", "--qemu"]) == 0
    assert cli.main(["qemu", "check"]) == 0
    assert calls == [*cli.qemu.QUEUES, *cli.qemu.QUEUES]
    assert calls[:2] == ["dirty-discard", "device-init"]


def test_qemu_tree_tags_the_end_of_each_series(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    assert cli.main(["--dry-run", "qemu", "tree", str(tmp_path / "tree")]) == 0
    cap = capsys.readouterr()
    tags = [ln.split()[-1] for ln in cap.err.splitlines() if " tag -f " in ln]
    assert tags == [f"series/{q}" for q in cli.qemu.QUEUES]
    assert "series end at series/dirty-discard, series/device-init, " in cap.out

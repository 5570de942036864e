"""zeromix: guest script, parsing a recorded console, the report, a dry run."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from freepage_lab import cli, guestshell
from freepage_lab.scenarios import zeromix
from freepage_lab.shell import LabError

DATA = Path(__file__).parent / "data"
RECORDED = DATA / "zeromix-uml-console.log"


def recorded_lines(path: Path = RECORDED) -> list[str]:
    """Console text of a lab guest log ("[  time] text" per line)."""
    return [re.sub(r"^\[\s*[\d.]+\] ", "", ln) for ln in path.read_text().splitlines()]


def test_script_runs_the_cycles_without_flushing_inside_them():
    p = zeromix.ZeromixParams(cycles=5, file_mib=64, anon_mib=100, idle_s=3)
    script = zeromix.guest_script(p, "qemu")
    before, loop = script.split("while", 1)
    assert "while [ $i -lt 5 ]; do" in script
    assert "dd if=/dev/urandom of=/tmp/zeromix.file bs=1M count=64" in loop
    assert "populate --mib 100 --mode 4k --verify --fill 0x5a --tag cycle-$i" in loop
    assert "sleep 3" in loop and "rm /tmp/zeromix.file" in loop
    # the one flush comes before the cycles; reporting then runs on its own
    assert guestshell.FLUSH in before and guestshell.FLUSH not in loop
    # the file is written before the populate, deleted after it
    assert loop.index("dd ") < loop.index("populate --") < loop.index("rm ")
    order = re.findall(r"snap \$i (\w+)", loop)
    assert tuple(order) == zeromix.POINTS
    assert "percpu_pagelist_high_fraction" not in script


def test_script_options_per_platform():
    p = zeromix.ZeromixParams(initial_flush=False)
    assert guestshell.FLUSH not in zeromix.guest_script(p, "qemu")
    assert "echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction" in zeromix.guest_script(p, "uml")
    p = zeromix.ZeromixParams(pcp_high_fraction=8)
    assert "echo 8 > /proc/sys/vm/percpu_pagelist_high_fraction" in zeromix.guest_script(p, "qemu")


@pytest.mark.skipif(not shutil.which("busybox"), reason="busybox not installed")
def test_snapshot_function_prints_one_json_line():
    out = subprocess.run(["busybox", "sh", "-c", zeromix.SNAPSHOT_FUNCTION + "\nsnap 3 start"],
                         capture_output=True, text=True, check=True).stdout
    rec = json.loads(out)
    assert rec["prog"] == "vmstat" and rec["cycle"] == 3 and rec["at"] == "start"
    assert isinstance(rec["nr_free_pages"], int)


def test_variant_names_map_to_bench_patches():
    assert zeromix.variant_patches("on") == ()
    assert zeromix.variant_patches("on+no-zero-preference") == ("no-zero-preference.patch",)
    for bad in ("off", "on+", "vanilla+x"):
        with pytest.raises(LabError, match="bad variant"):
            zeromix.variant_patches(bad)


def test_recorded_console_parses_into_cycles():
    boot = zeromix.parse_console(recorded_lines())
    assert [c.cycle for c in boot.cycles] == list(range(12))
    for c in boot.cycles:
        assert c.nonzero_bytes == 0 and c.populate_cpu_ms >= 0 and c.populate_wall_ms > 0
        # a 128 MiB 4 KiB populate: at least 32768 zeroing pages, known zero or not
        done = c.around_populate_pages["pgzero_skipped"] + c.around_populate_pages["pgzero_missed"]
        assert done >= 32768
        assert c.hit_rate is not None and 0 <= c.hit_rate <= 1
        assert c.whole_cycle_pages["pgzero_skipped"] >= c.around_populate_pages["pgzero_skipped"]
    # the initial flush reported (and marked) most of the guest's free memory
    assert boot.initial_flush_pages["pgzero_marked_reported"] > 100_000
    assert boot.total_pages["pgzero_marked_reported"] == sum(
        c.whole_cycle_pages["pgzero_marked_reported"] for c in boot.cycles)


def test_incomplete_cycle_and_missing_counters_are_errors():
    lines = [ln for ln in recorded_lines() if '"tag":"cycle-3"' not in ln]
    with pytest.raises(LabError, match="cycle 3 is incomplete"):
        zeromix.parse_console(lines)
    with pytest.raises(LabError, match="no pgzero_skipped"):
        zeromix.parse_console(['{"prog":"vmstat","cycle":0,"at":"start","nr_free_pages":1}'])
    with pytest.raises(LabError, match="no complete cycle"):
        zeromix.parse_console(["FREEPAGE-BOOTED 0.1"])


def test_report_of_two_variants_has_a_difference_with_interval():
    boot = zeromix.parse_console(recorded_lines())
    params = zeromix.ZeromixParams(variants=("on", "on+x"), rounds=1)
    data, text = zeromix.report("uml", params, {"on": [boot], "on+x": [boot]})
    on = data["variants"]["on"]
    assert on["hit_rate"]["n"] == 12 and 0 <= on["hit_rate_pooled"] <= 1
    assert on["hit_rate_first_cycle"]["n"] == 1 and on["hit_rate_steady"]["n"] == 6
    assert on["marked_reported_pages_per_cycle"]["n"] == 12
    cmp = data["comparisons"]["on+x vs on"]
    d = cmp["hit_rate_difference"]
    assert d["difference"] == 0 and d["lo"] <= 0 <= d["hi"]
    assert "on+x - on" in text and "+0.0 pp" in text
    json.dumps(data)  # the run's JSON file


@pytest.mark.parametrize("platform,expect", [
    ("uml", "vhost-user-balloon"),
    ("qemu", "x-device-init-reported=on"),
])
def test_dry_run_prints_the_commands_and_runs_nothing(platform, expect, capsys, tmp_path,
                                                      monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "zeromix", "--platform", platform, "--accel", "tcg",
                     "--fragment", "bench.config", "--param", "rounds=2"]) == 0
    err = capsys.readouterr().err
    assert "$ make -C" in err and expect in err
    assert err.count("zeromix-") >= 2  # one guest per boot
    assert not (tmp_path / "runs").exists()


def test_vanilla_and_missing_bench_patch_are_clear_errors(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "zeromix", "--vanilla"]) == 1
    assert "drop --vanilla" in capsys.readouterr().err
    assert cli.main(["--dry-run", "run", "zeromix", "--accel", "tcg",
                     "--param", "variants=on,on+no-such-bench-patch"]) == 1
    assert "kernel/bench/no-such-bench-patch.patch does not exist" in capsys.readouterr().err

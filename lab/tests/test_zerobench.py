"""zerobench: guest script, parsing a recorded UML console, the dry run."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freepage_lab import cli, guestshell
from freepage_lab.guest import Guest
from freepage_lab.scenarios import zerobench
from freepage_lab.shell import LabError, Shell

DATA = Path(__file__).parent / "data"
# one boot per variant, recorded from a real run (trimmed: boot messages left out)
RECORDED = {v: DATA / f"zerobench-uml-{v}.log" for v in ("vanilla", "off", "on")}


def test_guest_script_dirties_reports_then_benchmarks_each_order():
    p = zerobench.ZerobenchParams(bench_mib=128, repeat=2, fastpath_n=1000, fastpath_repeat=3)
    script = zerobench.guest_script(p, (0, 9))
    lines = script.splitlines()
    assert lines.index("echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction") > 0
    assert script.count("populate --mib 128 --mode 4k --fill 0x5a --tag warm") == 4
    assert script.count(f"echo 1000000 > {guestshell.FLUSH}") == 4
    assert script.count("bench zero 0 128") == 2 and script.count("bench zero 9 128") == 2
    assert script.count("bench fastpath 1000") == 3
    assert "/sys/module/page_zeroed_bench/parameters/run" in script
    # per repetition: order 0 then order 9, each after its own dirty + report + settle
    zeros = [ln for ln in lines if ln.startswith("bench zero")]
    assert zeros == ["bench zero 0 128", "bench zero 9 128"] * 2
    i = lines.index("bench zero 9 128")
    assert lines[i - 4].startswith("populate --mib 128") and lines[i - 2] == "sleep 1"
    # fastpath last, after every zero run
    assert lines[-1] == "bench fastpath 1000"
    assert '\\"order\\":9" s' in script  # the vmstat line carries the order


def test_guest_script_is_valid_shell():
    sh = shutil.which("busybox") or shutil.which("sh")
    assert sh
    script = zerobench.guest_script(zerobench.ZerobenchParams(), (0, 9))
    argv = [sh, "sh", "-n"] if sh.endswith("busybox") else [sh, "-n"]
    subprocess.run([*argv, "/dev/stdin"], input=script.encode(), check=True)


@pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="needs busybox (the guest's sed)")
def test_json_is_cut_out_of_dmesg_lines():
    script = zerobench.guest_script(zerobench.ZerobenchParams(), (0,))
    expr = re.search(r"sed -n '([^']*)'", script)
    assert expr
    record = '{"prog":"page_zeroed_bench","test":"zero","order":0,"mib":1}'
    dmesg = f"[   12.340000] {record}\n[   12.350000] virtio_balloon: something else\n"
    out = subprocess.run(["/bin/busybox", "sed", "-n", expr.group(1)], input=dmesg.encode(),
                         capture_output=True, check=True).stdout.decode()
    assert out == record + "\n"


def replay(tmp_path: Path, log: Path) -> Guest:
    code = (f"import sys\nfor l in open({str(log)!r}):\n"
            "    sys.stdout.write(l); sys.stdout.flush()\n")
    return Guest("fake", [sys.executable, "-c", code], tmp_path / f"{log.stem}.log",
                 Shell(quiet=True))


def recorded_records(tmp_path: Path) -> tuple[dict, dict]:
    records, vmstat = {}, {}
    for variant, log in RECORDED.items():
        with replay(tmp_path, log) as g:
            assert g.wait_exit(10) == 0
            records[variant] = g.json_records(zerobench.BENCH_PROG)
            vmstat[variant] = g.json_records("vmstat")
    return records, vmstat


def test_recorded_console_parses(tmp_path):
    records, vmstat = recorded_records(tmp_path)
    on = records["on"]
    # printk's own copy carries a timestamp and is not counted twice
    assert [r["test"] for r in on] == ["zero", "zero", "fastpath"]
    zero = zerobench.zero_samples(on)
    assert set(zero) == {0, 9} and all(len(v) == 1 and v[0] > 0 for v in zero.values())
    fast = zerobench.fastpath_samples(on)
    assert all(len(v) == 1 and 10 < v[0] < 100000 for v in fast.values()), fast
    best = zerobench.fastpath_samples(on, best=True)
    assert all(len(best[t]) == 1 and 0 < best[t][0] <= fast[t][0] for t in fast), (best, fast)
    skipped, missed = zerobench.hit_counts(vmstat["on"], 9)
    assert skipped > 0 and skipped > 10 * missed
    assert zerobench.hit_counts(vmstat["vanilla"], 0) == (0, 0)  # stock kernel: no counters


def test_recorded_run_summarises_into_ratios_and_a_table(tmp_path):
    records, vmstat = recorded_records(tmp_path)
    params = zerobench.ZerobenchParams(repeat=1, rounds=1, fastpath_repeat=1)
    data = zerobench.summarise_run(params, (0, 9), records, vmstat)
    for order in ("0", "9"):
        entry = data["zero"][order]
        assert entry["ratio_on_over_off"]["ratio"] < 0.5  # known zero: no clearing
        assert entry["on"]["hit_rate"] > 0.9
        # off: tracking stays disabled, nothing counted; vanilla: no counters at all
        assert entry["off"]["hit_rate"] is None and entry["vanilla"]["hit_rate"] is None
        assert "ratio_off_over_vanilla" not in entry  # the stock kernel cannot flush
    for test in zerobench.FASTPATH_TESTS:
        assert set(data["fastpath"][test]) >= {"ratio_off_over_vanilla", "ratio_on_over_vanilla",
                                               "ratio_off_over_vanilla_best_chunk"}
    text = zerobench.render(params, (0, 9), data)
    assert "on/off" in text and "off/vanilla" in text and "batch512" in text
    assert "best chunk ns/op" in text


def test_a_run_shorter_than_one_chunk_has_no_best_chunk():
    rec = {"test": "fastpath", "n": 100, "batch512_pages": 512, "order0_total_ns": 10000,
           "order0_chunk_ops": 1024, "order0_best_chunk_ns": 0, "batch512_total_ns": 51200,
           "batch512_chunk_ops": 512, "batch512_best_chunk_ns": 51200, "order3_total_ns": 20000,
           "order3_chunk_ops": 1024, "order3_best_chunk_ns": 0}
    assert zerobench.fastpath_samples([rec]) == {"order0": [100.0], "batch512": [100.0],
                                                 "order3": [200.0]}
    assert zerobench.fastpath_samples([rec], best=True) == {"order0": [], "batch512": [100.0],
                                                            "order3": []}


def test_bad_params_and_platform_are_clear_errors():
    scen = zerobench.Zerobench()
    with pytest.raises(LabError, match="order 11"):
        zerobench.check_params(scen.params({"orders": "0,11"}))
    with pytest.raises(LabError, match="bench_mib"):
        zerobench.check_params(scen.params({"bench_mib": "5000"}))
    with pytest.raises(LabError, match="unknown variants"):
        zerobench.check_params(scen.params({"variants": "on,limit"}))
    assert zerobench.check_params(scen.params({"orders": "3"})) == (3,)


def test_dry_run_boots_bench_kernels_and_runs_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "zerobench", "--platform", "uml",
                     "--fragment", "bench.config"]) == 0
    err = capsys.readouterr().err
    # stock and patched kernels, both with the bench patch and bench.config
    assert "um-release-vanilla+bench+page-zeroed-bench" in err
    assert "um-release-patched+bench+page-zeroed-bench" in err
    # off and vanilla run the daemon without bit 6, on with it: 2 rounds x 3 variants
    daemons = [ln for ln in err.splitlines() if "vhost-user-balloon --socket-path" in ln]
    assert len(daemons) == 6 and sum("--x-device-init-reported" in d for d in daemons) == 2
    assert not (tmp_path / "runs").exists()


def test_qemu_dry_run_counts_instructions(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "zerobench", "--platform", "qemu", "--accel", "tcg",
                     "--fragment", "bench.config", "--param", "rounds=1"]) == 0
    err = capsys.readouterr().err
    assert "x86_64-release-vanilla+bench+page-zeroed-bench" in err
    qemus = [ln for ln in err.splitlines() if "-icount shift=0,sleep=off" in ln]
    assert len(qemus) == 3
    # only "on" runs the patched QEMU with the balloon zeroing reported pages
    zeroing = [q for q in qemus if "x-device-init-reported=on" in q]
    assert len(zeroing) == 1 and not zeroing[0].startswith("$ qemu-system-x86_64 ")


def test_icount_needs_tcg_and_other_platforms_are_refused(capsys):
    assert cli.main(["--dry-run", "run", "zerobench", "--platform", "qemu",
                     "--accel", "kvm"]) == 1
    err = capsys.readouterr().err
    assert "kvm" in err

"""prezero scenarios: guest scripts, event parsing, summaries, the dry run."""

import shutil
import subprocess
import time

import pytest

from freepage_lab import cli, guestshell
from freepage_lab.initramfs import EVENT
from freepage_lab.scenarios import prezero, prezero_cost, prezero_cpu, prezero_footprint
from freepage_lab.shell import LabError, Shell


def sh_syntax_ok(script: str) -> None:
    sh = shutil.which("busybox") or shutil.which("sh")
    assert sh
    argv = [sh, "sh", "-n"] if sh.endswith("busybox") else [sh, "-n"]
    subprocess.run([*argv, "/dev/stdin"], input=script.encode(), check=True)


@pytest.mark.parametrize("variant", prezero.VARIANTS)
def test_guest_script_dirties_waits_then_measures(variant):
    p = prezero.PrezeroParams(populate_mib=256)
    script = prezero.guest_script(p, ("4k", "hugetlb", "kzero9"), variant)
    sh_syntax_ok(script)
    lines = script.splitlines()
    # only "on" enables the thread
    assert ("knob enabled 1" in lines) == (variant == "on")
    for mode in ("4k", "hugetlb"):
        i = lines.index(f"populate --mib 256 --mode {mode} --fill 0xa5 --tag dirty")
        assert lines[i + 2] == f"prezero_wait 600 {mode}"
        assert lines[i + 5].startswith(f"populate --mib 256 --mode {mode} --verify --tag measure")
    assert "echo 128 > /proc/sys/vm/nr_hugepages" in lines
    # the limit patch spares user pages only: no in-kernel run for it
    assert ("bench zero 9 256" in lines) == (variant != "limit")


def test_wait_helper_stops_when_counters_stand_still():
    helpers = guestshell.prezero_helpers(stable_s=2)
    sh_syntax_ok(helpers)
    assert "[ $stable -lt 2 ]" in helpers and "-lt 256 ]" in helpers
    assert "pgzero_(marked_prezero|prezero_hugetlb)" in helpers


def test_events_and_deltas():
    lines = [f"{EVENT} start thp pgzero_marked_prezero 10 pgzero_skipped 5 ",
             "noise",
             f"{EVENT} warm thp pgzero_marked_prezero 262154 pgzero_skipped 5",
             f"{EVENT} waited thp seconds 7",
             f"{EVENT} measured thp pgzero_marked_prezero 262154 pgzero_skipped 262149"]
    events = prezero.parse_events(lines)
    assert [e[0] for e in events] == ["start", "warm", "waited", "measured"]
    assert prezero.delta(events, "thp", "start", "warm")["pgzero_marked_prezero"] == 262144
    assert prezero.delta(events, "thp", "warm", "measured") == {
        "pgzero_marked_prezero": 0, "pgzero_skipped": 262144}
    assert prezero.delta(events, "4k", "start", "warm") == {}


def measures(variant: str, ms: list[float]) -> list[prezero.Measure]:
    on = variant == "on"
    return [prezero.Measure("thp", x, {"pgzero_skipped": 262144 if on else 0},
                            300000 if on else 0, 0) for x in ms]


def test_summary_has_ratios_and_the_unconsumed_share(tmp_path):
    p = prezero.PrezeroParams(repeat=3)
    runs = {"vanilla": measures("vanilla", [1000, 1100, 900]),
            "off": measures("off", [1000, 1000, 1000]),
            "on": measures("on", [100, 110, 90]),
            "limit": measures("limit", [80, 85, 90])}
    data = prezero.summarise_run(p, ("thp",), runs)
    e = data["modes"]["thp"]
    assert e["speedup_on_over_vanilla"]["ratio"] == pytest.approx(10.0)
    assert e["on_over_limit"]["ratio"] == pytest.approx(100 / 85)
    assert e["on"]["unconsumed_share"] == pytest.approx((900000 - 3 * 262144) / 900000)
    assert e["vanilla"]["unconsumed_share"] is None
    data.update(platform="qemu", time_unit="ms")
    text = prezero.render(data, ("thp",), prezero.VARIANTS)
    assert "stock/on" in text and "10.00x" in text and "on/limit" in text
    png = prezero.plot(data, tmp_path / "p.png")
    assert png.stat().st_size > 1000


def test_params_are_checked():
    with pytest.raises(LabError, match="uml has no thp"):
        prezero.check_params(prezero.PrezeroParams(modes=("thp",)), "uml")
    with pytest.raises(LabError, match="unknown mode"):
        prezero.check_params(prezero.PrezeroParams(modes=("kzero11",)), "qemu")
    with pytest.raises(LabError, match="unknown variants"):
        prezero.check_params(prezero.PrezeroParams(variants=("fast",)), "qemu")
    assert prezero.check_params(prezero.PrezeroParams(), "uml") == ("4k", "kzero9", "kzero0")


def test_dry_run_builds_four_kernels_and_boots_no_balloon(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "prezero", "--platform", "uml",
                     "--fragment", "bench.config", "--param", "repeat=2"]) == 0
    err = capsys.readouterr().err
    assert "um-release-vanilla+bench+page-zeroed-bench" in err
    assert "um-release-patched+bench+page-zeroed-bench+unsafe-no-user-page-zeroing" in err
    boots = [ln for ln in err.splitlines() if " mem=2048M " in ln]
    assert len(boots) == 8 and not any("virtio_uml.device" in b for b in boots)


@pytest.mark.parametrize("variant", prezero_cost.VARIANTS)
def test_cost_script_walks_while_the_pool_is_cleared(variant):
    p = prezero_cost.PrezeroCostParams(walks=2, pool_mib=512)
    script = prezero_cost.guest_script(p, variant, 16384)
    sh_syntax_ok(script)
    lines = script.splitlines()
    assert ("knob enabled 1" in lines) == (variant != "off")
    assert ("knob nocache 0" in lines) == (variant == "cached")
    assert "knob cpu_percent" not in script  # the default rate
    walks = [i for i, ln in enumerate(lines) if ln.startswith("cachewalk --kib 16384")]
    assert len(walks) == 2
    for i in walks:
        assert lines[i - 2].startswith("populate --mib 512") and "window" in lines[i + 1]


def test_cost_windows_give_cpu_share_and_marked_pages():
    lines = [f"{EVENT} window 0 cpu_ns 50000000 exact 1 uptime_cs 1000 "
             "pgzero_marked_prezero 0 pgzero_prezero_aborted 0",
             '{"prog":"cachewalk"}',
             f"{EVENT} window 0 cpu_ns 250000000 exact 1 uptime_cs 1200 "
             "pgzero_marked_prezero 262144 pgzero_prezero_aborted 32"]
    w = prezero_cost.windows(lines)
    assert list(w) == [0]
    assert prezero_cost.cpu_share(*w[0]) == (pytest.approx(0.1), True)
    # a snapshot from ticks makes the share inexact
    ticks = dict(w[0][1], exact=0)
    assert prezero_cost.cpu_share(w[0][0], ticks)[1] is False


def test_cost_script_reads_kprezerod_cpu_time(tmp_path):
    """The guest's kcpu() finds the kprezerod threads among /proc/<pid>/stat,
    sums them and prefers schedstat; run here against a fake /proc."""
    script = prezero_cost.guest_script(prezero_cost.PrezeroCostParams(walks=1), "nt", 64)
    body = script[script.index("kcpu() {"):]
    body = body[:body.index("\n}\n") + 3]
    for pid, comm in ((7, "kswapd0"), (42, "kprezerod")):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S " + " ".join(["0"] * 10) + " 3 4 0 0\n")
    fake = body.replace("/proc/[0-9]*/stat", f"{tmp_path}/[0-9]*/stat")
    run = subprocess.run(["sh", "-c", fake + "kcpu"], capture_output=True, text=True)
    assert run.stdout.split() == ["70000000", "ticks"], run
    (tmp_path / "42" / "schedstat").write_text("123456789 5 6\n")
    run = subprocess.run(["sh", "-c", fake + "kcpu"], capture_output=True, text=True)
    assert run.stdout.split() == ["123456789", "schedstat"], run
    # one thread per node: kprezerod/<nid>, summed
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("43 (kprezerod/1) S " + " ".join(["0"] * 10)
                                          + " 0 0 0 0\n")
    (tmp_path / "43" / "schedstat").write_text("1000 5 6\n")
    run = subprocess.run(["sh", "-c", fake + "kcpu"], capture_output=True, text=True)
    assert run.stdout.split() == ["123457789", "schedstat"], run
    for pid in ("42", "43"):
        (tmp_path / pid / "schedstat").unlink()
    run = subprocess.run(["sh", "-c", fake + "kcpu"], capture_output=True, text=True)
    assert run.stdout.split() == ["70000000", "ticks"], run


def test_cost_summary_compares_with_off():
    walk = prezero_cost.Walk
    runs = {"off": [walk(10, 5, 0, 0, 0)] * 3, "nt": [walk(10.5, 5.02, 0.1, 900, 0)] * 3,
            "cached": [walk(20, 6, 0.1, 900, 16)] * 3}
    data = prezero_cost.summarise_run(prezero_cost.PrezeroCostParams(), 32768, runs)
    assert data["variants"]["cached"]["refill_over_off"]["ratio"] == pytest.approx(2.0)
    text = prezero_cost.render(data, prezero_cost.VARIANTS)
    assert "2.00x" in text and "10.0%" in text


def test_host_llc_size_is_read(tmp_path):
    f = tmp_path / "size"
    f.write_text("32768K\n")
    assert prezero_cost.host_llc_kib(f) == 32768
    f.write_text("8M\n")
    assert prezero_cost.host_llc_kib(f) == 8192
    assert prezero_cost.host_llc_kib(tmp_path / "missing") == 0


def test_footprint_script_has_an_off_then_an_on_window():
    p = prezero_footprint.PrezeroFootprintParams(window_s=30)
    script = prezero_footprint.guest_script(p)
    sh_syntax_ok(script)
    lines = script.splitlines()
    assert lines.index("ev off all") < lines.index("ev on all") < lines.index("knob enabled 1")
    assert lines.index("knob enabled 1") < lines.index("ev end all")
    assert lines.count("sleep 30") == 2 and "knob min_order 0" in lines


def test_footprint_dry_run_uses_the_balloon_daemon(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "run", "prezero_footprint", "--platform", "uml",
                     "--fragment", "bench.config", "--param", "repeat=1"]) == 0
    err = capsys.readouterr().err
    assert "vhost-user-balloon --socket-path" in err and "virtio_uml.device=" in err


def test_footprint_events_carry_the_reported_counter():
    # the footprint table's "reported" column reads it from the end event
    script = prezero_footprint.guest_script(prezero_footprint.PrezeroFootprintParams())
    assert "pgzero_marked_reported" in script
    events = prezero.parse_events(["FREEPAGE-EVENT end all pgzero_marked_reported 7"])
    assert events[0][2]["pgzero_marked_reported"] == 7


@pytest.mark.parametrize("variant", prezero.VARIANTS)
def test_pcp_high_fraction_applies_to_every_variant(variant):
    knob = "/proc/sys/vm/percpu_pagelist_high_fraction"
    script = prezero.guest_script(prezero.PrezeroParams(), ("4k",), variant)
    assert knob not in script  # default: the kernel's own per-cpu list sizes
    lines = prezero.guest_script(prezero.PrezeroParams(pcp_high_fraction=1000), ("4k",),
                                 variant).splitlines()
    i = lines.index(f"echo 1000 > {knob}")
    assert i < lines.index("populate --mib 1024 --mode 4k --fill 0xa5 --tag dirty")


def test_uml_guest_pinned_to_a_host_cpu(tmp_path):
    from freepage_lab.runners import GuestConfig, UmlRunner

    cfg = GuestConfig(kernel=tmp_path / "linux", initrd=tmp_path / "i.cpio", host_cpu=1)
    argv = UmlRunner(Shell(dry_run=True)).argv(cfg)
    assert argv[:4] == ["taskset", "-c", "1", str(tmp_path / "linux")]
    cfg.host_cpu = None
    assert UmlRunner(Shell(dry_run=True)).argv(cfg)[0] == str(tmp_path / "linux")


def test_cpu_held_runs_an_idle_spinner_and_leaves_nothing_behind():
    with prezero_cost.cpu_held(Shell(), 0):
        out = subprocess.run(["pgrep", "-f", "while :; do :; done"], capture_output=True,
                             text=True)
        pids = out.stdout.split()
        assert pids, "no spinner"
        policy = subprocess.run(["chrt", "-p", pids[0]], capture_output=True, text=True)
        assert "SCHED_IDLE" in policy.stdout, policy.stdout
    time.sleep(0.1)
    left = subprocess.run(["pgrep", "-f", "while :; do :; done"], capture_output=True,
                          text=True).stdout.split()
    assert not set(left) & set(pids), left


@pytest.mark.parametrize("bad,why", [({"hold_cpu": "1"}, "needs host_cpu"),
                                     ({"host_cpu": "4096"}, "CPUs")])
def test_cost_refuses_bad_cpu_params(tmp_path, bad, why):
    from freepage_lab.context import RunContext

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="uml")
    scen = prezero_cost.PrezeroCost()
    with pytest.raises(LabError, match=why):
        scen.run(ctx, scen.params(bad))


def test_cpu_script_sets_each_cap_once_per_repetition():
    p = prezero_cpu.PrezeroCpuParams(caps=(5, 10, 25), repeat=2, window_s=1)
    script = prezero_cpu.guest_script(p)
    sh_syntax_ok(script)
    lines = script.splitlines()
    caps = [ln.split()[1] for ln in lines if ln.endswith("/cpu_percent")]
    assert caps == ["5", "10", "25", "10", "25", "5"]
    assert script.count("sleep 1\n") == 6 and script.count(" start cpu_ns ") == 6


def test_cpu_windows_give_the_share_of_each_cap():
    lines = [f"{EVENT} cpu 10 0 start cpu_ns 0 exact 1 uptime_ms 1000 marked 0",
             f"{EVENT} cpu 10 0 end cpu_ns 99000000 exact 1 uptime_ms 2000 marked 25600",
             f"{EVENT} cpu 5 0 start cpu_ns 5 exact 1 uptime_ms 3000 marked 25600",
             f"{EVENT} cpu 5 0 end cpu_ns 60000005 exact 0 uptime_ms 4000 marked 500000",
             f"{EVENT} cpu 25 0 start cpu_ns 0 exact 1 uptime_ms 5000 marked 0"]
    ws = prezero_cpu.windows(lines, 1536)
    assert [(w.cap, round(w.share, 3), w.cleared_mib, w.exact) for w in ws] == [
        (5, 0.06, (500000 - 25600) / 256, False), (10, 0.099, 100.0, True)]
    p = prezero_cpu.PrezeroCpuParams(caps=(5, 10, 25))
    data = prezero_cpu.summarise_run(p, ws)
    assert data["caps"]["5"]["over_cap"] == 1 and data["caps"]["10"]["over_cap"] == 0
    assert data["caps"]["10"]["saturated"] == 1 and data["caps"]["5"]["saturated"] == 0
    text = prezero_cpu.render(data)
    assert "9.90%" in text and "6.00% [6.00-6.00] *" in text


@pytest.mark.parametrize("bad", [{"caps": "0"}, {"caps": "x"}, {"window_s": "0"},
                                 {"pool_mib": "4096"}])
def test_cpu_refuses_bad_params(tmp_path, bad):
    from freepage_lab.context import RunContext

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="qemu")
    scen = prezero_cpu.PrezeroCpu()
    with pytest.raises(LabError, match="prezero_cpu"):
        scen.run(ctx, scen.params(bad))


def test_cpu_runs_on_qemu_only(tmp_path):
    from freepage_lab.context import RunContext

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="uml")
    with pytest.raises(LabError, match="QEMU"):
        prezero_cpu.PrezeroCpu().run(ctx, prezero_cpu.PrezeroCpuParams())

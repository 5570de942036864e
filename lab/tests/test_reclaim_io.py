"""reclaim-io: the Debian guest's I/O workload, paced, and what it reports."""

import json
import re
import subprocess

import pytest

from freepage_lab import cli, dryrun
from freepage_lab.scenarios import get
from freepage_lab.scenarios.reclaim_io import (
    IO_PROG,
    ReclaimIoParams,
    held_passes,
    io_functions,
    io_rates,
    io_script,
    pace,
)
from freepage_lab.shell import LabError


def test_each_worker_is_paced_to_its_share_of_the_rate():
    assert pace(16, 4) == "0.250"
    script = io_functions(ReclaimIoParams(io_mib_s=32, io_chunk_mib=4))
    assert "worker read 0.250 " in script
    assert "worker disk_write 0.500 " in script and "worker tmpfs_write 0.500 " in script
    # the reader goes through the page cache and drops it again
    assert "iflag=nocache" in script and "conv=fdatasync" in script


def test_the_guest_script_parses_and_runs_the_io_around_the_rounds():
    script = io_script(ReclaimIoParams())
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)
    lines = script.splitlines()
    assert lines.index("io_start") < next(i for i, ln in enumerate(lines) if "populate --mib" in ln)
    assert lines[-1] == "io_stop"
    assert "held_passes" in script  # the series' counters, sampled


def test_a_reporting_order_is_set_before_the_first_populate():
    knob = "/sys/module/page_reporting/parameters/page_reporting_order"
    assert not [ln for ln in io_script(ReclaimIoParams()).splitlines() if ln.endswith(f"> {knob}")]
    lines = io_script(ReclaimIoParams(reporting_order=6)).splitlines()
    first = next(i for i, ln in enumerate(lines) if "populate --mib" in ln)
    assert lines.index(f"echo 6 > {knob}") < first


def test_compaction_proactiveness_is_set_only_when_asked():
    knob = "/proc/sys/vm/compaction_proactiveness"
    assert knob not in io_script(ReclaimIoParams())
    lines = io_script(ReclaimIoParams(compaction_proactiveness=100)).splitlines()
    first = next(i for i, ln in enumerate(lines) if "populate --mib" in ln)
    assert lines.index(f"echo 100 > {knob}") < first
    for bad in (-2, 101):
        with pytest.raises(LabError, match="0 to 100"):
            io_script(ReclaimIoParams(compaction_proactiveness=bad))


def test_compaction_after_the_free_only_when_asked():
    knob = "echo 1 > /proc/sys/vm/compact_memory"
    assert knob not in io_script(ReclaimIoParams())
    lines = io_script(ReclaimIoParams(compact_after_free=1)).splitlines()
    freed = next(i for i, ln in enumerate(lines) if ln.endswith(" freed 0"))
    # at once after the free, before the settle the release is timed over
    assert lines[freed + 1] == knob and lines[freed + 2].startswith("sleep ")
    with pytest.raises(LabError, match="0 or 1"):
        io_script(ReclaimIoParams(compact_after_free=2))


def test_the_workload_keeps_its_rate_and_says_what_it_did(tmp_path):
    """The workers on the host for about two seconds at 8 MiB/s in all."""
    p = ReclaimIoParams(io_mib_s=8, io_chunk_mib=1)
    script = "\n".join([io_functions(p, str(tmp_path / "disk"), str(tmp_path / "tmpfs")),
                        "io_start", "sleep 2", "io_stop"])
    out = subprocess.run(["sh", "-e"], input=script, text=True, capture_output=True,
                         check=True, timeout=60).stdout
    record = json.loads(out.strip().splitlines()[-1])
    assert record["prog"] == IO_PROG
    rates = io_rates([record])
    # 4 + 2 + 2 MiB/s, one chunk either side of the window
    assert 5 <= rates["io"] <= 12, rates
    assert rates["read"] > rates["disk_write"] > 0 and rates["tmpfs_write"] > 0
    assert not (tmp_path / "disk" / "write").exists()


def test_without_io_no_worker_starts_and_the_record_says_zero(tmp_path):
    p = ReclaimIoParams(io_mib_s=0)
    script = "\n".join([io_functions(p, str(tmp_path / "disk"), str(tmp_path / "tmpfs")),
                        "io_start", "sleep 0.2", "io_stop"])
    assert "worker read" not in script
    out = subprocess.run(["sh", "-e"], input=script, text=True, capture_output=True,
                         check=True, timeout=60).stdout
    assert io_rates([json.loads(out.strip().splitlines()[-1])])["io"] == 0


def test_held_passes_count_over_the_trace():
    trace = [{"t_s": 1.0, "held_passes": 3, "passes": 10},
             {"t_s": 2.0, "held_passes": 9, "passes": 12}]
    assert held_passes(trace) == (6, 2)
    assert held_passes([{"held_passes": None, "passes": 1}]) == (0, 0)


def test_reclaim_io_runs_only_where_the_guest_has_a_disk_root(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main([*dryrun.argv("reclaim-io", "qemu", ()), "--accel", "tcg"]) != 0
    assert "qemu-debian" in capsys.readouterr().err
    assert "qemu-debian" in get("reclaim-io").platforms


def test_the_debian_platform_boots_the_qemu_kernel_from_its_root_disk(capsys, tmp_path,
                                                                       monkeypatch):
    """One x86_64 kernel for both QEMU platforms: the Debian root needs no
    kernel build of its own (x86_64.config has its block layer and ext4)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FREEPAGE_CACHE", str(cache))
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main([*dryrun.argv("reclaim-io", "qemu-debian", ()), "--accel", "tcg"]) == 0
    err = capsys.readouterr().err
    assert "mmdebstrap --variant=minbase" in err
    # file I/O needs Debian's essential packages alone: no compiler, no QEMU
    # (the root make test boots)
    debstrap = [ln for ln in err.splitlines() if "mmdebstrap" in ln]
    assert debstrap and not any("--include" in ln for ln in debstrap), debstrap
    qemu = [ln for ln in err.splitlines() if ln.startswith("$ qemu-system-x86_64")]
    assert qemu and all(re.search(r"/x86_64-release-patched-[0-9a-f]+/", ln)
                        and "fp.root=/dev/vda" in ln for ln in qemu), qemu
    assert all(f"file={cache}/debian/guest-" in ln for ln in qemu)


def test_an_unknown_parameter_is_refused():
    with pytest.raises(LabError):
        get("reclaim-io").params({"io_mibs": "3"})

"""vmcreate: the VM's firmware, QEMU's command line, the guest script,
parsing a boot's console, summaries, the dry run; one slow test starts
the VM on the host's QEMU with vmstart."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from freepage_lab import cli, dryrun, initramfs
from freepage_lab.guest import ConsoleLine
from freepage_lab.initramfs import EVENT
from freepage_lab.scenarios import get
from freepage_lab.scenarios import vmcreate as vm
from freepage_lab.shell import LabError, Shell

DATA = Path(__file__).parent / "data"


def test_firmware_is_a_64k_image_with_the_reset_vector_at_its_end():
    image = vm.firmware()
    assert len(image) == 64 * 1024
    # real mode at F000:FFF0: mov dx, 0x3f8; mov al, '!'; out dx, al; cli; hlt
    assert image[-16:-6] == bytes([0xBA, 0xF8, 0x03, 0xB0, 0x21, 0xEE, 0xFA, 0xF4, 0xEB, 0xFD])
    # the jump (EB FD: -3 from its end) goes back to the hlt; hlt pads the rest
    code = image[-16:]
    assert code[8:10] == b"\xeb\xfd" and code[10 - 3] == 0xF4 and code[10:] == b"\xf4" * 6
    assert image[:-16] == bytes(len(image) - 16)


def test_the_guest_writes_the_firmware_byte_for_byte(tmp_path):
    dest = tmp_path / "fw.bin"
    subprocess.run(["sh", "-c", vm.firmware_shell(str(dest))], check=True)
    assert dest.read_bytes() == vm.firmware()


def test_qemu_argv_preallocates_the_backend_the_machine_uses():
    argv = vm.qemu_argv(2048, True, "/tmp/fw.bin")
    assert argv[0] == "qemu-system-x86_64"
    backend = argv[argv.index("-object") + 1]
    assert backend.startswith("memory-backend-ram,id=vm-ram,size=2048M,")
    assert "prealloc=on" in backend and "prealloc-threads=1" in backend
    assert argv[argv.index("-machine") + 1] == "pc,memory-backend=vm-ram"
    assert argv[argv.index("-m") + 1] == "2048M"
    assert argv[argv.index("-bios") + 1] == "/tmp/fw.bin"
    # the serial port is QEMU's stdout, nothing else is on the machine
    assert argv[argv.index("-serial") + 1] == "stdio" and "-nodefaults" in argv
    assert "prealloc=off" in vm.qemu_argv(64, False)[argv.index("-object") + 1]
    with pytest.raises(LabError):
        vm.qemu_argv(0, True)


def sh_syntax_ok(script: str) -> None:
    busybox = shutil.which("busybox")
    argv = [busybox, "sh", "-n"] if busybox else ["sh", "-n"]
    subprocess.run([*argv, "/dev/stdin"], input=script.encode(), check=True)


@pytest.mark.parametrize("variant", ("vanilla", "off", "on", "limit"))
def test_guest_script_warms_dirties_then_waits_and_starts_the_vm_per_mode(variant):
    p = vm.VmcreateParams(mem_mib=1536, vm_mib=1024)
    script = vm.guest_script(p, variant)
    sh_syntax_ok(script)
    lines = script.splitlines()
    assert ("knob enabled 1" in lines) == (variant == "on")
    # the unmeasured start, then one dirtying of the free memory, before any measured start
    warm = next(i for i, ln in enumerate(lines) if ln.startswith("vmstart --tag warmup"))
    assert "size=64M,prealloc=on" in lines[warm]
    dirty = lines.index("populate --mib $((free - 256)) --mode 4k --fill 0xa5 --tag dirty")
    assert warm < dirty and sum(ln.startswith("populate ") for ln in lines) == 1
    for mode, thp in (("4k", "never"), ("thp", "madvise"), ("none", "never")):
        start = lines.index(f"ev start {mode}")
        assert dirty < start
        assert f"echo {thp} > /sys/kernel/mm/transparent_hugepage/enabled" in lines[start - 1]
        assert lines[start + 1:start + 4] == ["knob cpu_percent 100", f"prezero_wait 900 {mode}",
                                              "knob cpu_percent 10"]
        assert lines[start + 4] == f"ev warm {mode}"
        assert lines[start + 5] == f'echo "{EVENT} vm-start {mode}"'
        assert lines[start + 6].startswith(f"vmstart --tag {mode} --timeout-s 900 --mark "
                                           f"'{EVENT} vm-first-byte {mode}' -- qemu-system")
        # none: QEMU's start alone, without prealloc
        prealloc = "off" if mode == "none" else "on"
        assert f"size=1024M,prealloc={prealloc}" in lines[start + 6]
        assert lines[start + 7] == f"ev measured {mode}"


@pytest.mark.parametrize("bad", [{"modes": ("4k", "1g")}, {"modes": ()}, {"repeat": 0},
                                 {"vm_mib": 1400}, {"vm_mib": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(LabError):
        vm.check_params(vm.VmcreateParams(**bad))


def console(name: str) -> list[ConsoleLine]:
    """A recorded console as the lab logs it: '[<host seconds>] <line>'."""
    out = []
    for raw in (DATA / name).read_text().splitlines():
        m = re.match(r"^\[\s*([\d.]+)\] (.*)$", raw)
        if m:
            out.append(ConsoleLine(float(m.group(1)), m.group(2)))
    return out


def records(lines: list[ConsoleLine]) -> list[dict]:
    return [json.loads(ln.text) for ln in lines if ln.text.startswith('{"prog":"vmstart"')]


# a stock boot's console (EVENT and JSON lines), stopped while its 4k VM started
RECORDED = "vmcreate-qemu-debian-vanilla.log"


def test_a_recorded_boot_stopped_before_its_first_start_says_so():
    lines = console(RECORDED)
    recs = records(lines)
    # the unmeasured start's line is there, with what vmstart read at the byte
    assert [r["tag"] for r in recs] == ["warmup"] and recs[0]["byte"] == vm.FIRST_BYTE
    assert recs[0]["cpu_ns"] > 0 and recs[0]["exit_status"] == 137
    assert vm.event_time(lines, "vm-start", "4k") == pytest.approx(614.066)
    with pytest.raises(LabError, match="no vmstart line for 4k"):
        vm.parse_starts(recs, lines, ("4k",), 1024)


def start_lines(mode: str, byte_t: float, **rec: object) -> list[ConsoleLine]:
    """A start as the guest prints it (constructed, with the series' counters)."""
    line = {"prog": "vmstart", "tag": mode, "outcome": "first_byte", "first_byte_ns": 2_000_000_000,
            "byte": vm.FIRST_BYTE, "cpu_ns": 1_500_000_000, "cpu_ticks": 150, "minflt": 300000,
            "rss_kib": 1100 * 1024, "anon_huge_kib": 0, "threads": 4, "exit_status": 137, **rec}
    return [ConsoleLine(10.0, f"{EVENT} start {mode} pgzero_marked_prezero 5 pgzero_skipped 1"),
            ConsoleLine(20.0, f"{EVENT} warm {mode} pgzero_marked_prezero 280005 pgzero_skipped 1"),
            ConsoleLine(20.5, f"{EVENT} vm-start {mode}"),
            ConsoleLine(byte_t, f"{EVENT} vm-first-byte {mode}"),
            ConsoleLine(byte_t + 1, json.dumps(line, separators=(",", ":"))),
            ConsoleLine(byte_t + 2, f"{EVENT} measured {mode} pgzero_marked_prezero 280010 "
                                    "pgzero_skipped 262001")]


def test_a_start_parses_into_times_memory_and_counters():
    lines = start_lines("4k", 80.5)
    (k4,) = vm.parse_starts(records(lines), lines, ("4k",), 1024)
    assert (k4.first_byte_ms, k4.cpu_ms, k4.cpu_ticks) == (2000, 1500, 150)
    assert k4.host_s == pytest.approx(60.0) and k4.rss_mib == 1100
    # pre-zeroed while warming, taken zero during the start
    assert k4.marked == 280000 and k4.counters["pgzero_skipped"] == 262000


def test_a_start_that_never_reached_its_vm_fails_with_the_reason():
    lines = start_lines("4k", 80.5, outcome="timeout", byte=0)
    with pytest.raises(LabError, match="did not reach its first instruction: timeout"):
        vm.parse_starts(records(lines), lines, ("4k",), 1024)
    lines = start_lines("4k", 80.5)
    with pytest.raises(LabError, match="less than the 4096 MiB preallocated"):
        vm.parse_starts(records(lines), lines, ("4k",), 4096)
    lines = start_lines("4k", 80.5, cpu_ns=-1)
    with pytest.raises(LabError, match="schedstat"):
        vm.parse_starts(records(lines), lines, ("4k",), 1024)
    # without prealloc the VM's memory is not resident, and need not be
    lines = start_lines("none", 30.0, rss_kib=90 * 1024)
    assert vm.parse_starts(records(lines), lines, ("none",), 1024)[0].rss_mib == 90


def starts(mode: str, ms: list[float], skipped: int = 0) -> list[vm.Start]:
    return [vm.Start(mode, x, x / 2, int(x / 20), x / 100, 1030.0, 0.0,
                     {"pgzero_skipped": skipped}, skipped) for x in ms]


def test_summary_has_the_speed_ups_and_the_counters():
    p = vm.VmcreateParams(modes=("4k",), variants=("vanilla", "off", "on"), repeat=3)
    runs = {"vanilla": starts("4k", [3000, 3300, 2700]),
            "off": starts("4k", [3000, 3000, 3000]),
            "on": starts("4k", [1000, 1100, 900], skipped=262144)}
    data = vm.summarise_run(p, runs)
    e = data["modes"]["4k"]
    assert e["vanilla_over_on"]["first_byte_ms"]["ratio"] == pytest.approx(3.0)
    assert e["vanilla_over_on"]["cpu_ms"]["ratio"] == pytest.approx(3.0)
    assert e["off_over_vanilla"]["first_byte_ms"]["ratio"] == pytest.approx(1.0)
    assert e["on"]["during_start"]["pgzero_skipped"] == 3 * 262144
    assert "on_over_limit" not in e
    data.update(platform="qemu-debian", time_unit="ms")
    text = vm.render(data)
    assert "stock/on" in text and "3.00x" in text and "786432" in text


def test_vmcreate_runs_only_in_the_debian_guest(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main([*dryrun.argv("vmcreate", "qemu", ()), "--accel", "tcg"]) != 0
    assert "qemu-debian" in capsys.readouterr().err


def test_dry_run_boots_stock_and_series_under_icount(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main([*dryrun.argv("vmcreate", "qemu-debian", ()), "--accel", "tcg",
                     "--fragment", "bench.config", "--param", "repeat=2"]) == 0
    err = capsys.readouterr().err
    assert "--include=gcc,make,time,qemu-system-x86" in err
    boots = [ln for ln in err.splitlines() if ln.startswith("$ qemu-system-x86_64")]
    # vanilla, off, on, twice; no balloon (pre-zeroing may take every order)
    assert len(boots) == 6 and not any("virtio-balloon" in b for b in boots)
    assert all("-icount shift=0,sleep=off" in b and "-m 1536M" in b for b in boots)
    assert sum("x86_64-release-vanilla+bench" in b for b in boots) == 2
    assert sum("x86_64-release-patched+bench" in b for b in boots) == 4


def test_parameters_from_the_command_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert get("vmcreate").params({"icount": "off"}).icount is False
    with pytest.raises(LabError):
        get("vmcreate").params({"vm_gib": "2"})


@pytest.mark.slow
def test_vmstart_times_the_host_qemu_to_the_firmware_byte(tmp_path):
    """The firmware, QEMU's command line and vmstart together, on the
    host's QEMU (no guest): the byte comes, QEMU held the preallocated
    memory, and no QEMU is left afterwards."""
    if not shutil.which(vm.QEMU):
        pytest.skip(f"no {vm.QEMU}")
    progs = initramfs.build_guest_programs(Shell())
    fw = tmp_path / "fw.bin"
    fw.write_bytes(vm.firmware())
    out = subprocess.run(["nice", "-n", "19", progs / "vmstart", "--tag", "host",
                          "--mark", "BYTE", "--timeout-s", "120", "--",
                          *vm.qemu_argv(128, True, str(fw))],
                         capture_output=True, text=True, timeout=180, check=True)
    mark, line = out.stdout.splitlines()
    rec = json.loads(line)
    assert mark == "BYTE" and rec["outcome"] == "first_byte" and rec["byte"] == vm.FIRST_BYTE
    assert rec["rss_kib"] >= 128 * 1024 and rec["cpu_ns"] > 0 and rec["exit_status"] == 137
    assert str(fw) not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                         text=True).stdout

"""Guest console handling, driven by a fake guest replaying a recorded log."""

import sys
from pathlib import Path

import pytest

from freepage_lab.guest import Guest, GuestError
from freepage_lab.procfs import group_members
from freepage_lab.shell import Shell

DATA = Path(__file__).parent / "data"


def replay(tmp_path, log: Path, then: str = "") -> Guest:
    code = (f"import sys,time\nfor l in open({str(log)!r}):\n"
            "    sys.stdout.write(l); sys.stdout.flush()\n" + then)
    return Guest("fake", [sys.executable, "-c", code], tmp_path / "console.log", Shell(quiet=True))


def test_exit_marker_and_json_records(tmp_path):
    with replay(tmp_path, DATA / "console-ok.log") as g:
        assert g.wait_exit(10) == 0
        recs = g.json_records("populate")
    assert len(recs) == 2 and recs[0]["mode"] == "4k" and recs[1]["nonzero_bytes"] == 0


def test_panic_is_reported_with_console_tail(tmp_path):
    with replay(tmp_path, DATA / "console-panic.log", "time.sleep(30)\n") as g:
        with pytest.raises(GuestError, match="Kernel panic") as exc:
            g.wait_exit(10)
    assert "No working init found" in str(exc.value)


def test_hang_times_out_and_kills_the_group(tmp_path):
    g = replay(tmp_path, DATA / "console-ok.log", "import subprocess\n"
               "subprocess.Popen(['sleep', '60']); time.sleep(60)\n")
    with g:
        with pytest.raises(GuestError, match="timed out"):
            g.wait_for("never printed", 1.0)
        pgid = g.pid
    assert group_members(pgid) == []  # nothing survived, not even the grandchild


def test_guest_that_dies_without_marker(tmp_path):
    log = tmp_path / "short.log"
    log.write_text("booting\n")
    with replay(tmp_path, log, "sys.exit(3)\n") as g:
        with pytest.raises(GuestError, match="stopped before"):
            g.wait_exit(10)


def test_interactive_guest_reads_what_the_host_types(tmp_path):
    code = "import sys\nline = sys.stdin.readline()\nprint('got', line.strip(), flush=True)\n"
    g = Guest("echo", [sys.executable, "-c", code], tmp_path / "console.log", Shell(quiet=True),
              interactive=True)
    with g:
        g.send("go")
        _, line, _ = g.wait_for(r"^got ", 10)
    assert line.text == "got go"


def test_uml_whose_fp_registers_the_host_refuses_says_why(tmp_path):
    """An AMX host's EFAULT ends in the panic and one line naming the cause."""
    with replay(tmp_path, DATA / "console-uml-xstate-efault.log", "time.sleep(30)\n") as g:
        with pytest.raises(GuestError, match="Kernel panic") as exc:
            g.wait_exit(10)
    said = str(exc.value)
    assert "cause: the host refused UML's FP registers (EFAULT)" in said
    assert "kernel/platform/um" in said


def test_a_panic_the_host_did_not_cause_names_no_cause(tmp_path):
    with replay(tmp_path, DATA / "console-panic.log", "time.sleep(30)\n") as g:
        with pytest.raises(GuestError) as exc:
            g.wait_exit(10)
    assert "cause:" not in str(exc.value)

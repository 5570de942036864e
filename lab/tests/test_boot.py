"""Real guests: UML and QEMU boots, a reclaim run, failures that must end cleanly."""

from pathlib import Path

import pytest

from freepage_lab import harness, hostcheck, kernel, paths
from freepage_lab.context import RunContext
from freepage_lab.guest import GuestError
from freepage_lab.procfs import group_members
from freepage_lab.scenarios import reclaim
from freepage_lab.shell import LabError, Shell

pytestmark = pytest.mark.slow
MIB = 1 << 20
CHECK_SCRIPT = """populate --mib 32 --mode 4k --verify --tag boot
populate --mib 32 --mode thp --verify --tag boot
ls /sys/bus/virtio/drivers/virtio_balloon | grep -q virtio
"""


def boot(lab, ctx: RunContext, script: str, variant: harness.Variant, timeout: float = 120,
         **plan) -> list[dict]:
    """The populate records of a boot that exited 0 without a kernel warning."""
    booted = lab.boot(ctx, f"test-{ctx.platform}", script, variant, timeout_s=timeout, **plan)
    return booted.records("populate")


def test_uml_boots_and_hands_out_zeroed_memory(lab):
    # no balloon on UML without a daemon
    recs = boot(lab, lab.context("uml"), CHECK_SCRIPT.replace("ls /sys", "true || ls /sys"),
                lab.BARE, mem_mib=256)
    assert [r["nonzero_bytes"] for r in recs] == [0, 0]


FPKEEP = "fpkeep --procs 4 --rounds 20000\n"


def xsave_line(booted: harness.Booted) -> str:
    said = [ln for ln in booted.lines if ln.startswith("Host XSAVE area for ptrace:")]
    assert said, "the UML kernel did not say how large the host's XSAVE area is"
    return said[0]


def test_uml_keeps_fp_registers_in_an_area_sized_from_the_host(lab):
    """kernel/platform/um: UML measures the host's XSAVE area at start-up as
    the host check does, and every process keeps its vector registers
    across system calls, switches and fork."""
    size, why = hostcheck.ptrace_xstate_bytes()
    assert size is not None, why or "this host has no XSAVE regset"
    booted = lab.boot(lab.context("uml"), "test-uml-fp", FPKEEP, lab.BARE, mem_mib=128)
    fp = max(size, hostcheck.UML_6_12_FP_BYTES)
    assert xsave_line(booted) == f"Host XSAVE area for ptrace: {size} bytes, FP registers: {fp} bytes"
    [rec] = booted.records("fpkeep")
    assert rec["fork_kept"] and rec["procs_changed"] == 0


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "series"])
def test_uml_runs_where_the_hosts_xsave_area_outgrows_6_12s_buffer(lab, patched):
    """On a host with AMX (an 11008-byte area) a 6.12 UML kernel without
    kernel/platform/um dies at its first user process (EFAULT); the lab's
    stock and series kernels run."""
    size, why = hostcheck.ptrace_xstate_bytes()
    if size is None or size <= hostcheck.UML_6_12_FP_BYTES:
        pytest.skip(f"this host's XSAVE area is {size or why or 'absent'} bytes, within the "
                    f"{hostcheck.UML_6_12_FP_BYTES} that 6.12 UML passes: only a host with a "
                    "larger one (AMX: 11008) shows the fix")
    ctx = lab.context("uml", patched=patched)
    booted = lab.boot(ctx, "test-uml-amx", FPKEEP, lab.BARE, mem_mib=128)
    assert xsave_line(booted).endswith(f"FP registers: {size} bytes")
    [rec] = booted.records("fpkeep")
    assert rec["fork_kept"] and rec["procs_changed"] == 0


# the QEMU boots run the series' kernel, the one x86_64 kernel make test
# builds (the demo and the gate tests build stock's to compare with)
def test_qemu_boots_with_balloon_bound_and_a_real_clock(lab):
    # jiffies lose ticks under TCG: guest-side timings would be fiction
    clock = "! grep -q jiffies /sys/devices/system/clocksource/clocksource0/current_clocksource\n"
    recs = boot(lab, lab.context("qemu", patched=True), CHECK_SCRIPT + clock, lab.PLAIN,
                mem_mib=512)
    assert [r["nonzero_bytes"] for r in recs] == [0, 0]


def test_qemu_reclaim_gives_back_80_percent_within_30s(lab):
    ctx = lab.context("qemu", patched=True)
    scen = reclaim.ReclaimScenario()
    params = scen.params({"repeat": "1", "settle_s": "30", "populate_mib": "512", "modes": "thp",
                         "variants": "context"})
    out = scen.run(ctx, params)
    rnd = out.data["rounds"][0]
    tl = out.data["timeline"]
    t0 = rnd["t_freed_s"]
    before = rnd["before_bytes"] / MIB
    within = [m for t, m in zip(tl["t_s"], tl["footprint_mib"]) if t0 <= t <= t0 + 30]
    assert before - min(within) >= 0.8 * 512, out.table
    assert out.data["sample_rate_hz"] >= 10
    assert Path(out.plots[0]).stat().st_size > 0


def test_panicking_guest_fails_precisely_and_leaves_nothing(lab):
    ctx = lab.context("qemu", patched=True)
    pids = []
    with pytest.raises(GuestError, match="Kernel panic"):
        with lab.start(ctx, "panic", "true\n", lab.PLAIN, mem_mib=256,
                       cmdline=("rdinit=/does-not-exist", "init=/does-not-exist")) as run:
            pids.append(run.guest.pid)
            run.wait_exit(120)
    assert pids and group_members(pids[0]) == []


def test_hanging_guest_times_out_and_leaves_nothing(lab):
    ctx = lab.context("uml")
    pids = []
    with pytest.raises(GuestError, match="timed out") as exc:
        with lab.start(ctx, "hang", "sleep 600\n", lab.BARE, mem_mib=128) as run:
            pids.append(run.guest.pid)
            run.guest.wait_for("FREEPAGE-BOOTED", 60)
            run.wait_exit(3)
    assert "FREEPAGE-BOOTED" in str(exc.value)  # the console tail is part of the message
    assert pids and group_members(pids[0]) == []


def test_config_that_does_not_stick_is_a_precise_build_error(tmp_path, monkeypatch):
    frags = tmp_path / "configs"
    frags.mkdir()
    for f in paths.CONFIG_DIR.glob("*.config"):
        (frags / f.name).write_text(f.read_text())
    (frags / "bad.config").write_text("CONFIG_FREEPAGE_DOES_NOT_EXIST=y\n")
    real_base = paths.cache_dir() / "base"
    monkeypatch.setattr(paths, "CONFIG_DIR", frags)
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "base").symlink_to(real_base)
    spec = kernel.BuildSpec("x86_64", patched=False, extra_fragments=("bad.config",))
    with pytest.raises(LabError, match="CONFIG_FREEPAGE_DOES_NOT_EXIST: wanted y, got n"):
        kernel.build(Shell(), spec)

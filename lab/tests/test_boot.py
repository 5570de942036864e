"""Real guests: UML and QEMU boots, a reclaim run, failures that must end cleanly."""

from pathlib import Path

import pytest

from freepage_lab import kernel, paths
from freepage_lab.context import RunContext
from freepage_lab.guest import GuestError
from freepage_lab.procfs import group_members
from freepage_lab.runners import GuestConfig
from freepage_lab.scenarios import reclaim
from freepage_lab.shell import LabError, Shell

pytestmark = pytest.mark.slow
MIB = 1 << 20
CHECK_SCRIPT = """populate --mib 32 --mode 4k --verify --tag boot
populate --mib 32 --mode thp --verify --tag boot
ls /sys/bus/virtio/drivers/virtio_balloon | grep -q virtio
"""


def ctx_for(tmp_path: Path, platform: str) -> RunContext:
    return RunContext(shell=Shell(), run_dir=tmp_path, platform=platform, accel="tcg")


def boot(ctx: RunContext, script: str, timeout: float = 120, **kw) -> tuple[int, list[dict]]:
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("t", script), **kw)
    with ctx.runner().guest(f"test-{ctx.platform}", cfg, ctx.log("t")) as g:
        rc = g.wait_exit(timeout)
        return rc, g.json_records("populate")


def test_uml_boots_and_hands_out_zeroed_memory(tmp_path):
    ctx = ctx_for(tmp_path, "uml")
    rc, recs = boot(ctx, CHECK_SCRIPT.replace("ls /sys", "true || ls /sys"), mem_mib=256)
    assert rc == 0
    assert [r["nonzero_bytes"] for r in recs] == [0, 0]


def test_qemu_boots_with_balloon_bound_and_a_real_clock(tmp_path):
    ctx = ctx_for(tmp_path, "qemu")
    # jiffies lose ticks under TCG: guest-side timings would be fiction
    clock = "! grep -q jiffies /sys/devices/system/clocksource/clocksource0/current_clocksource\n"
    rc, recs = boot(ctx, CHECK_SCRIPT + clock, mem_mib=512)
    assert rc == 0
    assert [r["nonzero_bytes"] for r in recs] == [0, 0]


def test_qemu_reclaim_gives_back_80_percent_within_30s(tmp_path):
    ctx = ctx_for(tmp_path, "qemu")
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


def test_panicking_guest_fails_precisely_and_leaves_nothing(tmp_path):
    ctx = ctx_for(tmp_path, "qemu")
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("p", "true\n"), mem_mib=256,
                      cmdline=["rdinit=/does-not-exist", "init=/does-not-exist"])
    g = ctx.runner().guest("panic", cfg, ctx.log("panic"))
    with pytest.raises(GuestError, match="Kernel panic"):
        with g:
            g.wait_exit(120)
    assert group_members(g.pid) == []


def test_hanging_guest_times_out_and_leaves_nothing(tmp_path):
    ctx = ctx_for(tmp_path, "uml")
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("h", "sleep 600\n"), mem_mib=128)
    g = ctx.runner().guest("hang", cfg, ctx.log("hang"))
    with pytest.raises(GuestError, match="timed out") as exc:
        with g:
            g.wait_for("FREEPAGE-BOOTED", 60)
            g.wait_exit(3)
    assert "FREEPAGE-BOOTED" in str(exc.value)  # the console tail is part of the message
    assert group_members(g.pid) == []


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

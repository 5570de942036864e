"""The harness: variants, boot order, and the checks every boot gets (no real guest).

A replaying runner stands in for UML and QEMU: its "guest" prints a
recorded console (tests/data/console-*.log) and exits, so a whole
scenario runs up to its first boot's checks without a kernel.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from freepage_lab import harness, kernel, paths, scenarios
from freepage_lab.backend import BalloonBackend
from freepage_lab.context import RunContext
from freepage_lab.guest import Guest, GuestError
from freepage_lab.runners import GuestConfig, Runner
from freepage_lab.shell import Shell

DATA = Path(__file__).parent / "data"


class Replay(Runner):
    """A guest that prints a recorded console and powers off."""

    name = "replay"

    def __init__(self, console: Path) -> None:
        super().__init__(Shell(quiet=True))
        self.console = console
        self.configs: list[GuestConfig] = []

    def argv(self, cfg: GuestConfig) -> list[str]:
        self.configs.append(cfg)
        return [sys.executable, "-c", f"print(open({str(self.console)!r}).read(), end='')"]

    def footprint_bytes(self, guest: Guest) -> int | None:
        return None


@pytest.fixture
def replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A context whose boots replay `console`: no kernel, initramfs, VMM or daemon."""

    def make(platform: str, console: str) -> tuple[RunContext, Replay]:
        runner = Replay(DATA / console)
        monkeypatch.setattr(harness, "runner", lambda ctx, variant: runner)
        monkeypatch.setattr(RunContext, "kernel", lambda self, **kw: tmp_path / "kernel")
        monkeypatch.setattr(RunContext, "initrd", lambda self, name, script, selftests=(): tmp_path / name)
        monkeypatch.setattr(BalloonBackend, "start", lambda self: None)
        monkeypatch.setattr(BalloonBackend, "stop", lambda self: None)
        return RunContext(shell=Shell(quiet=True), run_dir=tmp_path, platform=platform,
                          accel="tcg"), runner

    return make


# one scenario per platform, each of which ignored kernel warnings before
# every boot went through the harness
WARNED = [("uml", "churn", {"repeat": "1", "variants": "stock"}),
          ("qemu", "realloc", {"rounds": "1"}),
          ("arm64", "split", {"rounds": "1"})]


@pytest.mark.parametrize(("platform", "name", "params"), WARNED, ids=[w[0] for w in WARNED])
def test_a_kernel_warning_fails_the_scenario(replay, platform, name, params):
    ctx, _ = replay(platform, "console-warning.log")
    scenario = scenarios.get(name)
    with pytest.raises(GuestError, match=r"kernel warned: .*WARNING: CPU: 0 PID: 61 at "
                                         r"mm/page_alloc.c:1290"):
        scenarios.run(scenario, ctx, scenario.params(params))


def test_a_clean_boot_passes_with_its_marks_and_probes(replay):
    ctx, runner = replay("uml", "console-clean.log")
    plan = harness.Plan("true\n", marks=("start", "done"), timeout_s=30)
    booted = harness.boot(ctx, harness.family("reporting")["off"], "clean", plan)
    assert booted is not None and booted.rc == 0
    assert list(booted.marks) == ["start", "done"]
    vmm, daemon, seconds = booted.between("start", "done")
    assert seconds >= 0 and daemon.faults == 0
    # the device the variant asked for; UML's daemon socket set by the harness
    cfg = runner.configs[0]
    assert not cfg.free_page_reporting and cfg.vhost_user_balloon == ctx.run_dir / "clean.sock"


def test_warnings_before_boot_are_kunit_s_and_do_not_count():
    lines = ["WARNING: at lib/kunit/test.c:10 on purpose", "FREEPAGE-BOOTED 1.0", "ok"]
    assert harness.kernel_warnings(lines) == []
    assert harness.kernel_warnings([*lines, "WARNING: CPU: 0 PID: 1"]) == ["WARNING: CPU: 0 PID: 1"]


def test_a_failed_script_fails_before_its_warnings_are_looked_at(tmp_path):
    guest = Guest("g", ["true"], tmp_path / "g.log", Shell(quiet=True))
    booted = harness.Booted("g", harness.CONTEXT, guest, Replay(tmp_path / "none"), rc=3)
    with pytest.raises(GuestError, match="guest script failed \\(exit 3\\)"):
        harness.check(booted)


def test_daemon_and_qemu_follow_the_variant(tmp_path):
    ctx = RunContext(shell=Shell(dry_run=True, quiet=True), run_dir=tmp_path, platform="uml",
                     patched=True, patched_qemu=True)
    reporting = harness.family("reporting")
    assert harness.daemon_args(reporting["off"]) == ["--no-reporting"]
    assert harness.daemon_args(reporting["freepage"]) == []
    # the context's device offers the experimental zeroing bits
    both = ["--x-device-init-reported", "--x-device-init-on-inflate"]
    assert harness.daemon_args(harness.CONTEXT) == both
    assert harness.daemon_args(harness.family("zeroing")["on"]) == both
    # reclaim's host side on UML is the daemon's: it offers the bits
    assert harness.daemon_args(harness.family("reclaim")["freepage"]) == both
    assert harness.zeroing(ctx, harness.CONTEXT)
    assert not harness.zeroing(ctx.on("uml", patched=False), harness.CONTEXT)


def test_every_family_names_distinct_variants_and_pick_refuses_strangers():
    for name, variants in harness.FAMILIES.items():
        assert variants and all(v.name == k for k, v in variants.items()), name
    assert [v.name for v in harness.pick("x", "zeroing", ["on", "vanilla"])] == ["on", "vanilla"]
    with pytest.raises(Exception, match="unknown variants \\['nope'\\]"):
        harness.pick("x", "zeroing", ["on", "nope"])


def test_the_per_cpu_list_variant_is_on_with_its_bench_patch():
    family = harness.family("zeroing")
    for name in ("pcp-drop",):
        v = family[name]
        assert v.extra_patches == (f"{name}.patch",), v
        assert replace(v, name="on", extra_patches=()) == family["on"]
        assert (paths.REPO / "kernel" / "bench" / v.extra_patches[0]).is_file()


def test_boot_order_abba_and_rotation():
    assert [harness.order("ab", r) for r in range(3)] == [list("ab"), list("ba"), list("ab")]
    assert [harness.order("abc", r, rotate=True) for r in range(3)] == [
        list("abc"), list("bca"), list("cab")]


def test_rounds_boot_every_variant_once_a_round_in_abba_order(replay):
    ctx, _ = replay("uml", "console-clean.log")
    variants = [harness.family("reporting")[n] for n in ("off", "stock")]
    plan = harness.Plan("true\n", timeout_s=30)
    names = [b.name for b in harness.rounds(ctx, variants, 2, "t", plan)]
    assert names == ["t-off-0", "t-stock-0", "t-stock-1", "t-off-1"]


def test_a_daemon_of_the_caller_serves_the_guest_and_outlives_it(replay):
    ctx, runner = replay("uml", "console-clean.log")
    daemon = BalloonBackend(ctx.shell, ctx.run_dir / "shared.sock", ctx.log("shared"))
    stopped = []
    daemon.stop = lambda: stopped.append(True)  # type: ignore[method-assign]
    plan = harness.Plan("true\n", timeout_s=30)
    with harness.start(ctx, harness.family("reporting")["off"], "g", plan, daemon=daemon,
                       mem_mib=64) as run:
        assert run is not None and run.backend is daemon
        assert run.wait_exit() == 0
    assert runner.configs[0].vhost_user_balloon == daemon.socket
    assert runner.configs[0].mem_mib == 64  # a GuestConfig override
    assert not stopped


def test_a_scenario_plan_takes_the_guest_size_from_the_parameters():
    p = scenarios.get("zeroskip").params({"mem_mib": "512", "timeout_s": "30"})
    plan = scenarios.Scenario.plan(p, "true\n", "z", mem_mib=256, marks=("a",))
    assert (plan.mem_mib, plan.timeout_s, plan.initrd, plan.marks) == (256, 30, "z", ("a",))
    assert scenarios.Scenario.plan(p, "true\n", "z").mem_mib == 512


def test_a_run_records_the_build_of_each_kernel_it_boots(tmp_path, monkeypatch):
    """A run directory names the cache directory of every kernel it used:
    a figure can be traced to its build (a bzImage once came back from
    ccache with another build's kernel, and no run said which it booted)."""
    built = []

    def build(shell, spec):
        out = tmp_path / "cache" / f"{spec.label}-0123456789abcdef"
        built.append(out)
        return kernel.BuiltKernel(spec, out, out / "bzImage", "0123456789abcdef")

    monkeypatch.setattr(kernel, "build", build)
    ctx = RunContext(shell=Shell(quiet=True), run_dir=tmp_path / "run", platform="qemu")
    ctx.kernel()
    ctx.on("qemu", patched=True).kernel()
    ctx.kernel()
    record = json.loads((tmp_path / "run" / "builds.json").read_text())
    assert record == {"kernel x86_64-release-vanilla": str(built[0]),
                      "kernel x86_64-release-patched": str(built[1])}

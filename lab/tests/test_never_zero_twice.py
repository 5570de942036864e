"""The kernel series on real guests: KUnit on UML, verified populates on QEMU and UML."""

from pathlib import Path

import pytest

from freepage_lab import kernel, kunit
from freepage_lab.context import RunContext
from freepage_lab.runners import GuestConfig
from freepage_lab.scenarios import zeroskip
from freepage_lab.shell import Shell

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]


def ctx_for(tmp_path: Path, platform: str) -> RunContext:
    return RunContext(shell=Shell(), run_dir=tmp_path, platform=platform, accel="tcg",
                      patched=True)


def test_kunit_suites_pass_on_uml(tmp_path):
    ctx = ctx_for(tmp_path, "uml")
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("k", "true\n"), mem_mib=256)
    with ctx.runner().guest("kunit", cfg, ctx.log("kunit")) as g:
        assert g.wait_exit(300) == 0
        res = kunit.parse([ln.text for ln in g.lines])
    assert "page_zeroed" in res.suites, res.suites
    assert res.ok, (res.failed, res.suites)
    assert res.passed >= 5


@pytest.mark.parametrize("platform", ["qemu", "uml"])
def test_reported_memory_reads_zero_and_zeroing_is_skipped(tmp_path, platform):
    """Debug verification on: every page handed out as known zero is checked."""
    ctx = ctx_for(tmp_path, platform)
    scen = zeroskip.Zeroskip()
    params = scen.params({"variants": "on", "rounds": "1", "repeat": "1",
                          "pcp_high_fraction": "1000" if platform == "uml" else "0"})
    out = scen.run(ctx, params)  # raises on a non-zero byte or a kernel warning
    for mode, entry in out.data["modes"].items():
        assert entry["on"]["pgzero_skipped"] > 0, (mode, out.table)

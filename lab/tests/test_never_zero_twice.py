"""The kernel series on real guests: KUnit on UML, verified populates on QEMU and UML."""

from pathlib import Path

import pytest

from freepage_lab import kernel, knobs, kunit
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


@pytest.mark.parametrize("cmdline", [[], ["init_on_free=1"]], ids=["default", "init_on_free"])
def test_kunit_suites_pass_on_uml(tmp_path, cmdline):
    """The suite holds whether free pages are zeroed by init_on_free or not."""
    ctx = ctx_for(tmp_path, "uml")
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("k", "true\n"), mem_mib=256,
                      cmdline=cmdline)
    with ctx.runner().guest("kunit", cfg, ctx.log("kunit")) as g:
        assert g.wait_exit(300) == 0
        res = kunit.parse([ln.text for ln in g.lines])
    assert "page_zeroed" in res.suites, res.suites
    assert res.ok, (res.failed, res.suites)
    assert res.suites["page_zeroed"]["pass"] >= 10, res.suites
    # the debug check counts what the suite does on purpose instead of warning
    assert not [ln.text for ln in g.lines if "WARNING" in ln.text or "Bad page" in ln.text]


def test_gigantic_hugetlb_pages_with_init_on_free(tmp_path):
    """init_on_free marks every free page zero; a 1 GiB page is assembled from
    many such chunks. Allocate, fault, verify and free one, twice: a chunk that
    kept its zeroed state shows up as a bad page on the free, a range cleared
    on the first chunk's word as non-zero bytes (debug checks on)."""
    ctx = ctx_for(tmp_path, "qemu")
    h = "/sys/kernel/mm/hugepages/hugepages-1048576kB"
    script = f"""[ -d {h} ] || {{ echo 'no 1 GiB huge page size' >&2; exit 3; }}
for round in 1 2; do
  echo 1 > {h}/nr_hugepages
  n=$(cat {h}/nr_hugepages)
  [ "$n" = 1 ] || {{ echo "round $round: $n gigantic pages allocated" >&2; exit 4; }}
  populate --mib 1024 --mode hugetlb-1g --verify --tag "gigantic-$round" || exit 5
  echo 0 > {h}/nr_hugepages
done
grep -E '^pgzero_' /proc/vmstat
"""
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("gigantic", script),
                      mem_mib=3072, cmdline=["init_on_free=1"], balloon=False)
    with ctx.runner().guest("gigantic", cfg, ctx.log("gigantic")) as g:
        rc = g.wait_exit(600)
        text = [ln.text for ln in g.lines]
    assert rc == 0, text[-20:]
    assert not [t for t in text if "Bad page" in t or "WARNING" in t], text
    runs = [r for r in g.json_records("populate")]
    assert [r["nonzero_bytes"] for r in runs] == [0, 0], runs
    marked = [t for t in text if t.startswith("pgzero_marked_init_on_free ")]
    assert marked and int(marked[0].split()[1]) > 0, "init_on_free marked nothing zero"


def test_device_init_bit_refused_with_page_poisoning(tmp_path):
    """Bit 6 (DEVICE_INIT_REPORTED) is negotiated on a plain boot and refused
    when pages are poisoned: a page the device zeroes is not a poisoned page."""
    from freepage_lab.backend import BalloonBackend

    ctx = RunContext(shell=Shell(), run_dir=tmp_path, platform="uml", patched=True,
                     variant="debug")
    bit = knobs.BIT_DEVICE_INIT_REPORTED
    script = f"""f={knobs.BALLOON_FEATURES}
echo "features $f"
"""
    seen = {}
    for name, cmdline in (("plain", []), ("poison", ["page_poison=1"])):
        backend = BalloonBackend(ctx.shell, tmp_path / f"{name}.sock", ctx.log(f"{name}-b"),
                                 [])
        cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd(name, script), mem_mib=256,
                          cmdline=cmdline, vhost_user_balloon=backend.socket)
        with backend, ctx.runner().guest(name, cfg, ctx.log(name)) as g:
            assert g.wait_exit(120) == 0
            line = next(ln.text for ln in g.lines if ln.text.startswith("features "))
        seen[name] = line.split()[1]
    assert seen["plain"][bit] == "1", seen
    assert seen["poison"][bit] == "0", seen


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

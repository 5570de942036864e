"""zerofirst: guest script and variants (no boot)."""

import pytest

from freepage_lab import guestshell
from freepage_lab.initramfs import EVENT
from freepage_lab.scenarios import zerofirst
from freepage_lab.shell import LabError


def test_script_marks_the_work_and_reports_before_it():
    p = zerofirst.ZerofirstParams(iterations=2)
    script = zerofirst.guest_script(p)
    for i in range(2):
        assert f"echo {EVENT} work {i}" in script and f"echo {EVENT} done {i}" in script
    # reported memory is flushed before the backed memory is freed, never after
    first = script.split(f"echo {EVENT} work 0")[0]
    assert first.index(guestshell.FLUSH) < first.index("--tag backed")
    assert "--verify" in script.split(f"echo {EVENT} work 0")[1].split("\n")[2]


def test_unknown_variant_is_refused(tmp_path):
    from freepage_lab.context import RunContext
    from freepage_lab.shell import Shell

    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="uml")
    scen = zerofirst.Zerofirst()
    with pytest.raises(LabError, match="unknown variant"):
        scen.run(ctx, scen.params({"variants": "vanilla,bogus", "rounds": "1"}))

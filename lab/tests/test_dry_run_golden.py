"""The commands that start guests and daemons in a few dry runs, pinned.

Each case's `freepage --dry-run run ...` output, normalised
(freepage_lab.dryrun.boots(): no paths of this tree, no stamps, no build
keys), must equal tests/data/dry-run/<case>.txt line for line: a variant
that boots another kernel, device, QEMU or daemon flag fails here. After
a change that is meant, rewrite the files with
    FREEPAGE_UPDATE_GOLDEN=1 pytest tests/test_dry_run_golden.py
and let the diff of tests/data/dry-run say what changed.
"""

import difflib
import os
from pathlib import Path

import pytest

from freepage_lab import cli, dryrun, paths

GOLDEN = Path(__file__).parent / "data" / "dry-run"
CASES = [
    ("reclaim", "uml", ()),  # the daemon's defaults, --no-reporting for off
    ("reclaim", "qemu", ("--patched-qemu",)),  # Debian's QEMU, off device named
    ("churn", "uml", ()),  # the daemon without bits 6 and 7
    ("churn", "qemu", ("--patched-qemu",)),  # the patched build, no bits 6 and 7
    ("zeroskip", "uml", ()),  # bits 6 and 7 for "on" only
    ("zeroskip", "qemu", ("--patched-qemu",)),  # the x- properties for on
    ("migrate", "qemu", ("--vanilla",)),  # hinting with an iothread, -incoming
    ("split", "arm64", ()),  # -icount, no balloon
    ("reclaim-io", "qemu-debian", ()),  # the Debian root on virtio-blk, snapshot=on
]


@pytest.mark.parametrize("scenario,platform,flags", CASES,
                         ids=[dryrun.label(*c) for c in CASES])
def test_dry_run_boots_what_it_booted(scenario, platform, flags, capsys, tmp_path,
                                      monkeypatch):
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    monkeypatch.setenv("FREEPAGE_CACHE", str(cache))
    monkeypatch.setenv("FREEPAGE_RUNS", str(runs))
    assert cli.main([*dryrun.argv(scenario, platform, flags), "--accel", "tcg"]) == 0
    text = dryrun.normalise(capsys.readouterr().err, paths.REPO, cache, runs)
    got = dryrun.boots(text)
    golden = GOLDEN / f"{dryrun.label(scenario, platform, flags)}.txt"
    if os.environ.get("FREEPAGE_UPDATE_GOLDEN"):
        golden.write_text("".join(f"{line}\n" for line in got))
    assert got, "no guest started"
    want = golden.read_text().splitlines()
    diff = difflib.unified_diff(want, got, f"tests/data/dry-run/{golden.name}", "this tree",
                                lineterm="", n=0)
    assert got == want, "the guests and daemons this dry run starts changed:\n" + "\n".join(diff)

"""Real arm64 guests: KVM initialises (VHE, nVHE) and dirty_log_test passes, stock and series."""

from pathlib import Path

import pytest

from freepage_lab.context import RunContext
from freepage_lab.runners import GuestConfig
from freepage_lab.shell import Shell

pytestmark = pytest.mark.slow

KVM_UP = {"vhe": "kvm [1]: VHE mode initialized successfully",
          "nvhe": "kvm [1]: Hyp nVHE mode initialized successfully"}
# 4 KiB guest pages (mode 6: 40-bit IPA), few short passes: a nested guest
# under TCG is slow; with eager splitting on, so the split walk runs
DIRTY_LOG_TEST = ("KVM_EAGER_SPLIT_CHUNK_SIZE=2097152 /kvm/dirty_log_test -m 6 -i 3 -I 1 -M {}"
                  " && echo DIRTY-LOG-{}-OK\n")
# dirty_log_test's log modes: bitmap, clear (manual protect), dirty ring
LOG_MODES = ("dirty-log", "clear-log")


def script(kvm_mode: str) -> str:
    lines = [f"dmesg | grep -F '{KVM_UP[kvm_mode]}'\n", "test -c /dev/kvm\n"]
    lines += [DIRTY_LOG_TEST.format(m, m) for m in LOG_MODES]
    return "".join(lines)


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "series"])
@pytest.mark.parametrize("kvm_mode", ["vhe", "nvhe"])
def test_arm64_kvm_initialises_and_dirty_log_test_passes(tmp_path: Path, kvm_mode: str,
                                                         patched: bool) -> None:
    ctx = RunContext(shell=Shell(), run_dir=tmp_path, platform="arm64", patched=patched)
    cmdline = ["kvm-arm.mode=nvhe"] if kvm_mode == "nvhe" else []
    cfg = GuestConfig(kernel=ctx.kernel(), initrd=ctx.initrd("t", script(kvm_mode)),
                      mem_mib=1024, smp=2, cmdline=cmdline, balloon=False)
    with ctx.runner().guest(f"arm64-{kvm_mode}", cfg, ctx.log("t")) as g:
        rc = g.wait_exit(600)
        text = "\n".join(ln.text for ln in g.lines)
    assert rc == 0, text[-3000:]
    assert KVM_UP[kvm_mode] in text
    for mode in LOG_MODES:
        assert f"DIRTY-LOG-{mode}-OK" in text

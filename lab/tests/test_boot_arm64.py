"""Real arm64 guests: KVM initialises (VHE, nVHE) and dirty_log_test passes, stock and series."""

import pytest

from freepage_lab import kunit

pytestmark = pytest.mark.slow

KVM_UP = {"vhe": "kvm [1]: VHE mode initialized successfully",
          "nvhe": "kvm [1]: Hyp nVHE mode initialized successfully"}
# 4 KiB guest pages (mode 6: 40-bit IPA), few short passes: a nested guest
# under TCG is slow; with eager splitting on, so the split walk runs
DIRTY_LOG_TEST = ("/kvm/dirty_log_test -S 2097152 -m 6 -i 3 -I 1 -M {}"
                  " && echo DIRTY-LOG-{}-OK\n")
KTAP_LINES = "(ok|not ok) [0-9]+ |# [a-z0-9_]+: pass:"
SPLIT_SUITE = "kvm_stage2_split"
# dirty_log_test's log modes: bitmap, clear (manual protect), dirty ring
LOG_MODES = ("dirty-log", "clear-log")


def script(kvm_mode: str, log_modes: tuple[str, ...]) -> str:
    lines = [f"dmesg | grep -F '{KVM_UP[kvm_mode]}'\n", "test -c /dev/kvm\n",
             # dirty_log_test maps a 1 GiB memslot it touches only in part
             "echo 1 > /proc/sys/vm/overcommit_memory\n"]
    lines += [DIRTY_LOG_TEST.format(m, m) for m in log_modes]
    # the series' KUnit suite ran at boot; show its KTAP lines (stock: none)
    lines.append(f"dmesg | grep -E '{KTAP_LINES}' || true\n")
    return "".join(lines)


# the series' KUnit suite on 16 and 64 KiB pages: a kernel of its own each
# (a cold build of ~10 minutes, no ccache hits across page sizes), so
# outside make test
PAGES_16K = "arm64-16k.config"
PAGES_64K = "arm64-64k.config"
# the series runs dirty_log_test in both log modes (split at enable, split
# at clear) under VHE and nVHE; stock once, as the reference to compare with
# where the series fails (gate: its own kernel build, which make test does
# not need); on 16 and 64 KiB pages, the series boots for its KUnit suite
CASES = [pytest.param("stock", "vhe", ("dirty-log",), (), marks=pytest.mark.gate,
                      id="stock-vhe"),
         pytest.param("stock", "nvhe", (), (), marks=pytest.mark.gate, id="stock-nvhe"),
         pytest.param("series", "vhe", LOG_MODES, (), id="series-vhe"),
         pytest.param("series", "nvhe", LOG_MODES, (), id="series-nvhe"),
         pytest.param("series", "vhe", (), (PAGES_16K,), marks=pytest.mark.gate,
                      id="series-vhe-16k"),
         pytest.param("series", "vhe", (), (PAGES_64K,), marks=pytest.mark.gate,
                      id="series-vhe-64k")]


@pytest.mark.parametrize(("kernel", "kvm_mode", "log_modes", "fragments"), CASES)
def test_arm64_kvm_initialises_and_dirty_log_test_passes(lab, kernel: str, kvm_mode: str,
                                                         log_modes: tuple[str, ...],
                                                         fragments: tuple[str, ...]) -> None:
    ctx = lab.context("arm64", accel="auto", patched=kernel == "series",
                      extra_fragments=fragments)
    cmdline = ("kvm-arm.mode=nvhe",) if kvm_mode == "nvhe" else ()
    with lab.start(ctx, f"arm64-{kernel}-{kvm_mode}", script(kvm_mode, log_modes), lab.BARE,
                   initrd="t", mem_mib=1536, smp=1, cmdline=cmdline) as run:
        rc = run.wait_exit(600)
        text = "\n".join(run.booted.lines)
    assert rc == 0, text[-3000:]
    assert KVM_UP[kvm_mode] in text
    for mode in log_modes:
        assert f"DIRTY-LOG-{mode}-OK" in text
    if kernel == "series":
        results = kunit.parse(text.splitlines())
        assert results.ok, results
        suite = results.suites[SPLIT_SUITE]
        if not fragments:
            # every case of the suite on 4 KiB pages, the -ENOMEM one included
            assert suite["pass"] >= 11, results
        else:
            # 16/64 KiB pages: the cases that need level-1 blocks skip (none in 6.12)
            assert suite["pass"] + suite["skip"] == suite["total"] >= 11, results
            assert all("no level-1 blocks" in why for why in results.skipped.values()), results

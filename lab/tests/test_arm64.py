"""The arm64 platform: cross builds, the second series, qemu-system-aarch64 with EL2."""

from pathlib import Path

import pytest

from freepage_lab import buildcache, kernel, paths, selftests
from freepage_lab.context import RunContext
from freepage_lab.runners import Arm64Runner, GuestConfig, make_runner
from freepage_lab.shell import LabError, Shell


def cfg(**kw):
    return GuestConfig(kernel=Path("/Image"), initrd=Path("/i"), **kw)


def test_arm64_argv_gives_the_guest_el2_and_gicv3():
    argv = Arm64Runner(Shell()).argv(cfg(mem_mib=1024, smp=2))
    assert argv[0] == "qemu-system-aarch64"
    assert argv[argv.index("-machine") + 1] == "virt,virtualization=on,gic-version=3"
    assert argv[argv.index("-cpu") + 1] == "max"
    assert argv[argv.index("-smp") + 1] == "2"
    assert argv[argv.index("-m") + 1] == "1024M"
    assert "-icount" not in argv
    append = argv[argv.index("-append") + 1]
    assert "console=ttyAMA0" in append and "fp.halt=reboot" in append
    assert "-no-reboot" in argv
    assert "virtio-balloon-device,id=balloon0,free-page-reporting=on" in argv


def test_arm64_nvhe_is_a_command_line_word_and_icount_counts_instructions():
    argv = Arm64Runner(Shell()).argv(cfg(cmdline=["kvm-arm.mode=nvhe"], icount=True))
    assert "kvm-arm.mode=nvhe" in argv[argv.index("-append") + 1]
    assert argv[argv.index("-icount") + 1] == "shift=0"


def test_arm64_refuses_kvm_and_auto_means_tcg():
    with pytest.raises(LabError, match="emulated"):
        make_runner("arm64", Shell(), "kvm")
    assert make_runner("arm64", Shell(), "auto").accel == "tcg"


def test_arm64_make_cross_compiles_with_ccache():
    argv = kernel.make_argv(Path("/s"), Path("/o"), "arm64", "olddefconfig", ccache=True)
    assert "ARCH=arm64" in argv and "CROSS_COMPILE=aarch64-linux-gnu-" in argv
    front = buildcache.CCACHE_FRONT
    assert f"CC={front} aarch64-linux-gnu-gcc" in argv and f"HOSTCC={front} gcc" in argv
    assert not any(a.startswith("CROSS_COMPILE") for a in
                   kernel.make_argv(Path("/s"), Path("/o"), "x86_64"))


def test_arm64_image_and_fragments_come_from_the_split_series():
    assert kernel.image_path(Path("/o"), "arm64") == Path("/o/arch/arm64/boot/Image")
    names = [f.name for f in kernel.BuildSpec("arm64").fragments()]
    assert names[:2] == ["common.config", "arm64.config"]
    assert "arm64-split.config" in names and "never-zero-twice.config" not in names
    stock = [f.name for f in kernel.BuildSpec("arm64", patched=False).fragments()]
    assert "arm64-split.config" not in stock
    assert kernel.queue_for("arm64").patch_dir == paths.KERNEL_DIR / "arm64-split" / "patches"
    x86 = [q.name for q in kernel.stack(kernel.queue_for("x86_64"))]
    assert x86 == ["page-reporting", "never-zero-twice", "prezero"]


def test_arm64_config_asks_for_kvm_thp_and_hugetlbfs():
    wanted = kernel.parse_fragment((paths.CONFIG_DIR / "arm64.config").read_text())
    for opt in ("CONFIG_KVM", "CONFIG_VIRTUALIZATION", "CONFIG_TRANSPARENT_HUGEPAGE",
                "CONFIG_HUGETLBFS", "CONFIG_SERIAL_AMBA_PL011_CONSOLE", "CONFIG_ARM_GIC_V3"):
        assert wanted[opt] == "y", opt


def test_selftests_are_static_cross_builds_of_the_named_programs():
    argv = selftests.build_argv(selftests.KVM, Path("/src"), Path("/out"))
    assert argv[:3] == ["make", "-C", "/src/tools/testing/selftests/kvm"]
    assert "ARCH=arm64" in argv and "EXTRA_CFLAGS=-static" in argv
    assert "CROSS_COMPILE=aarch64-linux-gnu-" in argv and "abs_objdir=/out/gen" in argv
    assert "KHDR_INCLUDES=-isystem /out/usr/include" in argv
    assert "/out/kvm/dirty_log_perf_test" in argv and "/out/kvm/dirty_log_test" in argv
    assert all(p.is_file() for p in selftests.KVM.series().files)


def test_arm64_dry_run_prints_the_build_and_the_boot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="arm64")
    image = ctx.kernel()
    assert image.name == "Image"
    initrd = ctx.initrd("t", "true\n")
    ctx.runner().guest("t", cfg(), tmp_path / "t.log")
    err = capsys.readouterr().err
    assert "CROSS_COMPILE=aarch64-linux-gnu-" in err
    assert "apt-get download busybox-static:arm64" in err
    assert "EXTRA_CFLAGS=-static" in err
    assert "CC=aarch64-linux-gnu-gcc" in err
    assert initrd.name == "t.cpio"

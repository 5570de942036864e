"""KVM selftests for the arm64 guest, cross-built statically from pristine 6.12.

User space does not change with the series, so one build serves the stock
kernel and the series alike: the pristine tree plus a test-only patch that
lets the environment turn eager splitting on
(kernel/arm64-split/bench/selftests-eager-split-env.patch).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from . import buildcache, kernel, paths, platforms
from .shell import Shell

# what the arm64 initramfs carries, relative to tools/testing/selftests/kvm
PROGRAMS = ("dirty_log_perf_test", "dirty_log_test", "kvm_page_table_test",
            "aarch64/page_fault_test")
ENV_PATCH = "selftests-eager-split-env.patch"
CROSS = platforms.arch("arm64").cross_compile


def series() -> kernel.Series:
    return kernel.Series(kernel.QUEUES["arm64-split"].bench_dir, (ENV_PATCH,))


def out_dir(shell: Shell) -> Path:
    s = series()
    h = hashlib.sha256(f"{kernel.base_version(shell)}\0{s.digest()}\0".encode())
    h.update(" ".join(PROGRAMS).encode())
    return paths.cache_dir() / "selftests" / f"kvm-arm64-{h.hexdigest()[:16]}"


def headers_argv(src: Path, out: Path) -> list[str]:
    return ["make", "-s", "-C", str(src), f"O={out / 'hdr'}", "ARCH=arm64",
            f"CROSS_COMPILE={CROSS}", f"INSTALL_HDR_PATH={out / 'usr'}", "headers_install"]


def build_argv(src: Path, out: Path, jobs: int = 2) -> list[str]:
    kvm = out / "kvm"
    return ["make", "-C", str(src / "tools" / "testing" / "selftests" / "kvm"), "ARCH=arm64",
            f"CROSS_COMPILE={CROSS}", f"OUTPUT={kvm}", f"abs_objdir={out / 'gen'}",
            f"KHDR_INCLUDES=-isystem {out / 'usr' / 'include'}", "EXTRA_CFLAGS=-static",
            f"-j{jobs}", *(str(kvm / p) for p in PROGRAMS)]


def build(shell: Shell) -> Path:
    """The directory holding PROGRAMS (cached)."""
    out = out_dir(shell)
    kvm = out / "kvm"
    cached = buildcache.Build("KVM selftests", "selftests", out, kvm / PROGRAMS[0],
                              out.with_suffix(".lock"), kvm)

    def make(src: Path, out: Path) -> bool:
        if not shell.dry_run:
            (out / "gen" / "tools").mkdir(parents=True, exist_ok=True)
        shell.run(headers_argv(src, out), log=out / "headers.log",
                  what="install arm64 uapi headers")
        shell.run(build_argv(src, out), log=out / "build.log", what="build KVM selftests")
        return not shell.dry_run

    buildcache.build_once(shell, cached, lambda: kernel.applied_tree(shell, series()), make)
    return kvm

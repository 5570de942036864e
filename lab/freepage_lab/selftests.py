"""The kernel's own selftests, built statically from pristine 6.12 for a guest.

A `Suite` is one directory of tools/testing/selftests built for one arch
(cross-built where the arch says so) and the programs the guest needs from
it. User space does not change with the series, so one build serves the
stock kernel and the series alike:

* `KVM` (arm64): the KVM selftests the arm64 initramfs carries under /kvm,
  with a test-only patch that gives dirty_log_perf_test and dirty_log_test
  an option to turn eager splitting on, -S <bytes>
  (kernel/arm64-split/bench/selftests-eager-split-option.patch);
* `MM` (x86_64): the mm selftests `freepage mm-selftests` runs (/mm),
  from the pristine tree as it is.

A build is cached by a hash of (base version, test-only patches, programs)
in ~/.cache/freepage/selftests/<suite>-<arch>-<hash>, from a hard-linked
tree of its own: the mm Makefile writes its probe results (local_config.h)
next to its sources, so suites do not share the trees kernels build in.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from . import buildcache, kernel, patchqueue, paths, platforms
from .shell import Shell


@dataclass(frozen=True)
class Suite:
    """One selftests directory, built statically for one arch."""

    # tools/testing/selftests/<name>; the guest's directory is /<name>
    name: str
    arch: str
    # what the guest carries, relative to the suite's directory
    programs: tuple[str, ...]
    # test-only patches on the pristine tree, and where they live
    patches: tuple[str, ...] = ()
    bench_dir: Path = paths.KERNEL_DIR / "bench"
    # more make variables of the suite's Makefile (name=value)
    make_vars: tuple[str, ...] = ()

    @property
    def cross(self) -> str:
        return platforms.arch(self.arch).cross_compile

    def series(self) -> kernel.Series:
        return kernel.Series(self.bench_dir, self.patches)

    def out_dir(self, shell: Shell) -> Path:
        h = hashlib.sha256(f"{kernel.base_version(shell)}\0{self.series().digest()}\0".encode())
        h.update(" ".join(self.programs).encode())
        return paths.cache_dir() / "selftests" / f"{self.name}-{self.arch}-{h.hexdigest()[:16]}"

    def tree(self, shell: Shell) -> Path:
        """The pristine tree with the suite's patches, hard-linked, its own."""
        h = hashlib.sha256(f"{kernel.base_version(shell)}\0{self.series().digest()}".encode())
        where = paths.cache_dir() / "selftests" / "src" / h.hexdigest()[:16]
        return patchqueue.applied_tree(shell, kernel.base_tree(shell), where, self.series(),
                                       "base tree")


KVM = Suite("kvm", "arm64",
            ("dirty_log_perf_test", "dirty_log_test", "kvm_page_table_test",
             "aarch64/page_fault_test"),
            patches=("selftests-eager-split-option.patch",),
            bench_dir=kernel.QUEUES["arm64-split"].bench_dir,
            make_vars=("abs_objdir={out}/gen",))

# mm selftests of 6.12 for x86_64 that a guest of the lab can run (see
# mmtests.LEFT_OUT for the others and why); libnuma, liburing and libcap
# come from scripts/install-deps.sh
MM = Suite("mm", "x86_64", (
    "compaction_test", "cow", "droppable", "gup_longterm", "gup_test", "hugepage-mmap",
    "hugepage-mremap", "hugepage-shm", "hugepage-vmemmap", "hugetlb-madvise", "hugetlb_dio",
    "hugetlb_fault_after_madv", "hugetlb_madv_vs_map", "ksm_functional_tests",
    "ksm_tests", "madv_populate", "map_fixed_noreplace", "map_hugetlb", "map_populate",
    "mdwe_test", "memfd_secret", "mkdirty", "mlock-random-test", "mlock2-tests",
    "mrelease_test", "mremap_dontunmap", "mremap_test", "mseal_test", "pagemap_ioctl",
    "seal_elf", "soft-dirty", "split_huge_page_test", "thuge-gen", "transhuge-stress",
    "uffd-stress", "uffd-unit-tests", "virtual_address_range"))

SUITES = {s.name: s for s in (KVM, MM)}


def headers_argv(suite: Suite, src: Path, out: Path) -> list[str]:
    argv = ["make", "-s", "-C", str(src), f"O={out / 'hdr'}", f"ARCH={suite.arch}"]
    if suite.cross:
        argv.append(f"CROSS_COMPILE={suite.cross}")
    return argv + [f"INSTALL_HDR_PATH={out / 'usr'}", "headers_install"]


def build_argv(suite: Suite, src: Path, out: Path, jobs: int = 2) -> list[str]:
    bins = out / suite.name
    argv = ["make", "-C", str(src / "tools" / "testing" / "selftests" / suite.name),
            f"ARCH={suite.arch}"]
    if suite.cross:
        argv.append(f"CROSS_COMPILE={suite.cross}")
    argv += [f"OUTPUT={bins}", *(v.format(out=out) for v in suite.make_vars),
             f"KHDR_INCLUDES=-isystem {out / 'usr' / 'include'}", "EXTRA_CFLAGS=-static",
             f"-j{jobs}"]
    return argv + [str(bins / p) for p in suite.programs]


def build(shell: Shell, suite: Suite = KVM) -> Path:
    """The directory holding the suite's programs (cached)."""
    out = suite.out_dir(shell)
    bins = out / suite.name
    label = f"{suite.name} selftests ({suite.arch})"
    cached = buildcache.Build(label, "selftests", out, bins / suite.programs[0],
                              out.with_suffix(".lock"), bins)

    def make(src: Path, out: Path) -> bool:
        if not shell.dry_run:
            # the mm Makefile links into OUTPUT without making it
            bins.mkdir(parents=True, exist_ok=True)
            (out / "gen" / "tools").mkdir(parents=True, exist_ok=True)
        shell.run(headers_argv(suite, src, out), log=out / "headers.log",
                  what=f"install {suite.arch} uapi headers")
        shell.run(build_argv(suite, src, out), log=out / "build.log",
                  what=f"build {suite.name} selftests")
        return not shell.dry_run

    buildcache.build_once(shell, cached, lambda: suite.tree(shell), make)
    return bins

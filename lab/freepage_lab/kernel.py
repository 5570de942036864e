"""The kernel side of the lab: pristine base, patch queue, cached builds."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from . import buildcache, patchqueue, paths, platforms
from .buildcache import cached_compiler, ccache_env, recipe_digest
from .shell import LabError, Shell, StageResult, timed

ARCHES = tuple(platforms.ARCHES)
VARIANTS = ("release", "debug")
# the make target every kernel's config fragments are merged onto: a
# kernel holds what the guests use, which keeps a cold build short
BASE_CONFIG = "tinyconfig"
PATCHED_FRAGMENTS = ("never-zero-twice.config",)


@dataclass(frozen=True, kw_only=True)
class Queue(patchqueue.Queue):
    """A kernel series (kernel/<name>/patches) with its test-only patches
    and the fragments of its builds."""

    bench_dir: Path
    fragments: tuple[str, ...]


def _x86_series(name: str, requires: tuple[str, ...] = ()) -> Queue:
    """A series of the x86/UML kernels: test-only patches in kernel/bench."""
    return Queue(name, paths.KERNEL_DIR, requires, bench_dir=paths.KERNEL_DIR / "bench",
                 fragments=PATCHED_FRAGMENTS)


QUEUES = {
    # applies to pristine 6.12 on its own
    "page-reporting": _x86_series("page-reporting"),
    "never-zero-twice": _x86_series("never-zero-twice", ("page-reporting",)),
    "prezero": _x86_series("prezero", ("page-reporting", "never-zero-twice")),
    # independent of the others: applies to pristine 6.12 on its own
    "arm64-split": Queue("arm64-split", paths.KERNEL_DIR,
                         bench_dir=paths.KERNEL_DIR / "arm64-split" / "bench",
                         fragments=("arm64-split.config",)),
}


# what the lab's kernels of an arch need to run on its hosts, applied before
# any series, to the stock kernel too (platforms.Arch.platform_series): not
# part of what the series ask a maintainer to take
PLATFORM_QUEUES = {a.name: Queue(a.platform_series, paths.KERNEL_DIR, bench_dir=paths.KERNEL_DIR,
                                 fragments=())
                   for a in platforms.ARCHES.values() if a.platform_series}


def with_platform(arch: str, series: Series) -> Series:
    """`series` after the platform patches of `arch` (PLATFORM_QUEUES)."""
    if arch not in PLATFORM_QUEUES:
        return series
    return Series.joined([PLATFORM_QUEUES[arch]]).plus(series.directory, series.names)


def stack(queue: Queue) -> list[Queue]:
    """The series to apply for `queue`, in order, ending with it."""
    return patchqueue.stack(QUEUES, queue)


def queue_for(arch: str) -> Queue:
    """The top series a patched kernel of this arch carries (with what it requires)."""
    return QUEUES["arm64-split" if arch == "arm64" else "prezero"]


# --------------------------------------------------------------------------
# Pristine base
# --------------------------------------------------------------------------

_VERSION: dict[bool, str] = {}


def base_version(shell: Shell) -> str:
    """Debian package version of the pristine source, e.g. 6.12.117-1~deb12u1."""
    if shell.dry_run in _VERSION:
        return _VERSION[shell.dry_run]
    try:
        out = shell.run(
            ["dpkg-query", "-W", "-f=${Version}", paths.BASE_PACKAGE],
            capture=True, what=f"dpkg-query {paths.BASE_PACKAGE}",
        ) if not shell.dry_run else "dry-run"
    except LabError:
        out = ""
    if not out:
        raise LabError(f"{paths.BASE_PACKAGE} is not installed: run `make deps`")
    _VERSION[shell.dry_run] = out.strip()
    return _VERSION[shell.dry_run]


def base_tree(shell: Shell) -> Path:
    """Extract the pristine source once; re-extract when the package changes."""
    version = base_version(shell)
    tree = paths.cache_dir() / "base" / "linux-source-6.12"
    marker = tree / ".freepage-extracted"
    if marker.exists() and marker.read_text().strip() == version:
        return tree
    if not paths.BASE_TARBALL.exists():
        raise LabError(f"{paths.BASE_TARBALL} missing: install {paths.BASE_PACKAGE} (`make deps`)")
    if tree.exists() and not shell.dry_run:
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    shell.run(["tar", "-C", tree.parent, "-xf", paths.BASE_TARBALL], what="extract kernel source")
    if not shell.dry_run:
        marker.write_text(version + "\n")
    return tree


# --------------------------------------------------------------------------
# Patch queue
# --------------------------------------------------------------------------

# hash length of the series' index lines (patchqueue.work_tree())
ABBREV = 9

class Series(patchqueue.Series):
    """A kernel series (kernel/<series>/patches/series), or the patches of a
    queue and every series it requires."""

    @classmethod
    def load(cls, directory: Path = paths.PATCH_DIR) -> Self:
        return super().load(directory)

    @classmethod
    def empty(cls) -> Self:
        return cls(paths.KERNEL_DIR, ())

    @classmethod
    def stacked(cls, queue: Queue) -> Self:
        """Every patch of `queue` and the series it requires, in the order
        they apply, named relative to kernel/."""
        return cls.joined(stack(queue))


def tree_path(shell: Shell, series: Series) -> Path:
    """Where applied_tree() puts the source of (base version, series)."""
    h = hashlib.sha256(base_version(shell).encode() + b"\0")
    h.update((series.digest() if series.names else "vanilla").encode())
    return paths.cache_dir() / "src" / h.hexdigest()[:16]


def applied_tree(shell: Shell, series: Series) -> Path:
    """A source tree with the series applied (none: stock), cached by its hash.

    Kernels are built in direct subdirectories of it, so that kbuild names
    every source file relative to the build directory ("../mm/page_alloc.c"):
    compiler command lines do not depend on where the tree is, and ccache
    serves a rebuild after a series edit from the files the edit did not
    change.
    """
    return patchqueue.applied_tree(shell, base_tree(shell), tree_path(shell, series), series,
                                   "base tree")


def materialise(shell: Shell, queue: Queue, dest: Path) -> None:
    """A git work tree: base commit = pristine source, then one commit per
    patch of `queue` and the series it requires, each series ending at its
    tag (Queue.tag)."""
    patchqueue.work_tree(shell, base_tree(shell), dest, stack(queue),
                         f"base: {paths.BASE_PACKAGE} {base_version(shell)}", "base tree", ABBREV)


def export_stack(shell: Shell, tree: Path, queue: Queue) -> dict[str, list[str]]:
    """Export every series of `queue`'s stack from a work tree made by
    materialise() (patchqueue.export_stack())."""
    return patchqueue.export_stack(shell, tree, stack(queue))


def check(shell: Shell, queue: Queue) -> StageResult:
    """The series applies to the pristine base after the series it requires,
    and its patches are checkpatch --strict clean."""
    base = base_tree(shell)

    def checkpatch(patch: Path) -> str:
        try:
            shell.run([base / "scripts" / "checkpatch.pl", "--strict", "--quiet",
                       "--no-summary", patch], cwd=base, capture=True, what=f"checkpatch {patch.name}")
        except LabError as exc:
            return str(exc)
        return ""

    return patchqueue.check(shell, base, stack(queue), checkpatch, "pristine 6.12", "base tree")


# --------------------------------------------------------------------------
# Builds
# --------------------------------------------------------------------------

# --fragment files that apply to the stock kernel of a comparison too (the
# others set the series' own options, which a stock kernel does not have)
STOCK_FRAGMENTS = ("bench.config", "arm64-split-bench.config", "mm-selftests.config",
                   "irqsoff.config", "arm64-16k.config", "arm64-64k.config")


@dataclass(frozen=True)
class BuildSpec:
    arch: str
    variant: str = "release"
    patched: bool = True
    extra_fragments: tuple[str, ...] = ()
    # test-only patches from kernel/bench/, applied after the series
    extra_patches: tuple[str, ...] = ()
    # only the first N patches of the series (a step of it); 0: all
    series_patches: int = 0

    def __post_init__(self) -> None:
        platforms.arch(self.arch)
        if self.variant not in VARIANTS:
            raise LabError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.series_patches < 0 or (self.series_patches and not self.patched):
            raise LabError(f"series_patches={self.series_patches}: a number of patches of "
                           "the series, for a patched kernel")

    def fragments(self) -> list[Path]:
        names = ["common.config", f"{self.arch}.config"]
        if self.variant == "debug":
            names.append("debug.config")
        if self.patched:
            # the series' own options (with its debug checks and KUnit suites)
            names += [f for f in queue_for(self.arch).fragments
                      if (paths.CONFIG_DIR / f).is_file()]
        for name in self.extra_fragments:
            names.append(name)
            # a fragment's per-arch companion, e.g. bench-x86_64.config
            companion = f"{Path(name).stem}-{self.arch}.config"
            if (paths.CONFIG_DIR / companion).is_file():
                names.append(companion)
        out = []
        for name in names:
            frag = paths.CONFIG_DIR / name
            if not frag.is_file():
                raise LabError(f"config fragment {frag} does not exist")
            out.append(frag)
        return out

    @property
    def label(self) -> str:
        extra = "".join("+" + Path(f).stem for f in (*self.extra_fragments, *self.extra_patches))
        patched = f"patched{self.series_patches or ''}" if self.patched else "vanilla"
        return f"{self.arch}-{self.variant}-{patched}{extra}"


@dataclass(frozen=True)
class BuiltKernel:
    spec: BuildSpec
    out_dir: Path
    image: Path
    key: str


def parse_fragment(text: str) -> dict[str, str]:
    """CONFIG_FOO=y / # CONFIG_FOO is not set / CONFIG_FOO=n -> {FOO: value}."""
    wanted: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"^(CONFIG_[A-Za-z0-9_]+)=(.*)$", line)
        if m:
            wanted[m.group(1)] = m.group(2)
            continue
        m = re.match(r"^# (CONFIG_[A-Za-z0-9_]+) is not set$", line)
        if m:
            wanted[m.group(1)] = "n"
    return wanted


def config_mismatches(wanted: dict[str, str], final: dict[str, str]) -> list[str]:
    """Options a fragment asked for that Kconfig dropped (usually a missing dependency)."""
    bad = []
    for opt, val in sorted(wanted.items()):
        got = final.get(opt, "n")
        if val != got:
            bad.append(f"{opt}: wanted {val}, got {got}")
    return bad


def build_key(spec: BuildSpec, version: str, series: Series) -> str:
    h = hashlib.sha256()
    h.update(f"{version}\0{spec.arch}\0{BASE_CONFIG}\0{spec.variant}\0".encode())
    # a stock kernel with test-only patches is keyed by those patches too
    h.update((series.digest() if spec.patched or series.names else "vanilla").encode())
    h.update(recipe_digest())
    for frag in spec.fragments():
        h.update(frag.name.encode() + b"\0" + frag.read_bytes())
    return h.hexdigest()[:16]


def make_argv(src: Path, out: Path, arch: str, *targets: str, jobs: int | None = None,
              ccache: bool = False) -> list[str]:
    argv = ["make", "-C", str(src), f"O={out}", f"ARCH={arch}"]
    cross = platforms.arch(arch).cross_compile
    if cross:
        argv.append(f"CROSS_COMPILE={cross}")
    if ccache:
        argv += [f"CC={cached_compiler(cross + 'gcc')}", f"HOSTCC={cached_compiler('gcc')}"]
    if jobs:
        argv.append(f"-j{jobs}")
    return argv + list(targets)


def image_path(out: Path, arch: str) -> Path:
    return out / platforms.arch(arch).image


def build(shell: Shell, spec: BuildSpec, series: Series | None = None) -> BuiltKernel:
    """Configure and build, or return the cached build for the same inputs.

    A lock per build directory lets concurrent lab runs share one build.
    """
    queue = queue_for(spec.arch)
    if series is None:
        series = Series.stacked(queue) if spec.patched else Series.empty()
    if not spec.patched:
        series = Series.empty()
    elif spec.series_patches:
        if spec.series_patches > len(series.names):
            raise LabError(f"series_patches={spec.series_patches}: the series has "
                           f"{len(series.names)} patches")
        series = Series(series.directory, series.names[:spec.series_patches])
    series = with_platform(spec.arch, series).plus(queue.bench_dir, spec.extra_patches)
    version = base_version(shell)
    key = build_key(spec, version, series)
    # a direct child of its source tree: see applied_tree()
    out = tree_path(shell, series) / f"{spec.label}-{key}"
    image = image_path(out, spec.arch)
    cached = buildcache.Build(spec.label, "kernel", out, image,
                              paths.cache_dir() / "build" / f"{out.name}.lock", out)

    def make(src: Path, out: Path) -> bool:
        assert out.parent == src, (out, src)
        return _make(shell, spec, src, out, image)

    buildcache.build_once(shell, cached, lambda: applied_tree(shell, series), make)
    return BuiltKernel(spec, out, image, key)


def _make(shell: Shell, spec: BuildSpec, src: Path, out: Path, image: Path) -> bool:
    """Configure and build into `out`; False on a dry run (nothing built)."""
    cenv = ccache_env()
    cc = cenv is not None
    base_target = BASE_CONFIG
    shell.run(make_argv(src, out, spec.arch, base_target, ccache=cc), env=cenv,
              log=out / "config.log", what=f"make {base_target}")
    fragments = spec.fragments()
    shell.run([src / "scripts" / "kconfig" / "merge_config.sh", "-m", "-O", out,
               out / ".config", *fragments], cwd=src, log=out / "merge.log",
              what="merge config fragments")
    shell.run(make_argv(src, out, spec.arch, "olddefconfig", ccache=cc), env=cenv,
              log=out / "olddefconfig.log", what="make olddefconfig")
    if not shell.dry_run:
        wanted: dict[str, str] = {}
        for frag in fragments:
            wanted.update(parse_fragment(frag.read_text()))
        bad = config_mismatches(wanted, parse_fragment((out / ".config").read_text()))
        if bad:
            raise LabError(f"kernel config {spec.label}: fragment options did not stick:\n  "
                           + "\n  ".join(bad))
    jobs = os.cpu_count() or 2
    log = out / "build.log"
    argv = make_argv(src, out, spec.arch, jobs=jobs, ccache=cc)
    shell.show(argv)
    if shell.dry_run:
        return False
    start = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(cenv or {})})
        stop = threading.Event()
        ticker = threading.Thread(target=_progress, args=(spec.label, log, stop, start), daemon=True)
        ticker.start()
        try:
            rc = proc.wait()
        except BaseException:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
        finally:
            stop.set()
    if rc != 0:
        errors = [ln for ln in log.read_text(errors="replace").splitlines()
                  if "error" in ln.lower()][:15]
        raise LabError(f"kernel build {spec.label} failed (exit {rc}); see {log}\n"
                       + "\n".join(errors))
    if not image.exists():
        raise LabError(f"kernel build {spec.label} produced no {image}")
    return True


def _progress(label: str, log: Path, stop: threading.Event, start: float) -> None:
    while not stop.wait(15):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        last = lines[-1].strip() if lines else ""
        print(f"  build {label}: {time.monotonic() - start:4.0f} s, {len(lines)} steps, {last[:70]}",
              flush=True)


def build_stage(shell: Shell, spec: BuildSpec) -> tuple[StageResult, BuiltKernel | None]:
    finish = timed(f"build {spec.label}")
    try:
        kernel = build(shell, spec)
    except LabError as exc:
        return finish("failed", str(exc)), None
    return finish("ok", str(kernel.image)), kernel

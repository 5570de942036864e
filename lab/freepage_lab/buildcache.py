"""Cached builds, shared by kernel and QEMU: one output directory per key.

    buildcache.build_once(shell, build, source, make)

returns at once when the build's directory holds a finished build (a
done marker and its product); otherwise it gets the source tree
(`source()`, which may apply a series first), makes the directory afresh
and calls `make(src, out)`, which configures and builds into it. A lock per
key lets concurrent lab runs (and worktrees sharing the cache) share one
build: the second waits and then finds it done. A dry run takes no lock
and lets `make` print its commands.
"""

from __future__ import annotations

import fcntl
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .shell import Shell

DONE = ".freepage-done"
# the compiler front of cached builds (see its header)
CCACHE_FRONT = Path(__file__).with_name("ccache-front")


@dataclass(frozen=True)
class Build:
    """Where one build goes and what it must leave there."""

    # "kernel x86_64-release-patched", "qemu": for the progress lines
    label: str
    what: str
    out: Path
    # the file the build exists for (kernel image, QEMU binary)
    product: Path
    lock: Path
    # printed on a cache hit: the build directory or the product
    shown: Path

    def done(self) -> bool:
        return (self.out / DONE).exists() and self.product.exists()


def ccache_env() -> dict[str, str] | None:
    """ccache keyed on the sources and their includes, independent of the
    tree's path.

    Every series edit gives a new source tree; ccache turns the rebuild
    into recompiling only what the patches really changed.

    Depend mode: a miss compiles once and takes the includes from the
    compiler's dependency file (kbuild's -Wp,-MMD, meson's -MD). By
    default ccache runs the preprocessor once more on a miss, to hash its
    output, which made a cold UML build take 261 s against 182 s without
    ccache; 206 s in depend mode. Hits are direct-mode hits, as 97% of
    them were before. Assembler sources are compiled in preprocessor mode
    (cached_compiler()): no dependency file lists an .incbin.
    """
    if shutil.which("ccache") is None:
        return None
    cache = paths.cache_dir()
    return {"CCACHE_DIR": str(cache / "ccache"), "CCACHE_BASEDIR": str(cache),
            "CCACHE_NOHASHDIR": "1", "CCACHE_MAXSIZE": "8G", "CCACHE_DEPEND": "1"}


def cached_compiler(compiler: str) -> str:
    """`compiler` through ccache, for kbuild's CC= and meson's CC: C in
    depend mode, assembler sources in preprocessor mode (ccache-front)."""
    return f"{CCACHE_FRONT} {compiler}"


def recipe_digest() -> bytes:
    """What a build's key holds beside its sources and configuration: the
    compiler front. Builds made through an earlier front may hold a stale
    object (an x86 bzImage with the kernel of another build), so changing
    the front makes every build afresh (ccache still serves its C)."""
    return CCACHE_FRONT.read_bytes()


Source = Callable[[], Path]
Make = Callable[[Path, Path], bool]


def build_once(shell: Shell, build: Build, source: Source, make: Make) -> None:
    """Make `build` unless it is done; `make(src, out)` builds into the
    fresh directory and returns False where it did not (a dry run)."""
    if shell.dry_run:
        _locked(shell, build, source, make)
        return
    with exclusive(build.lock, f"build {build.label}: waiting for another build of the "
                   f"same {build.what}"):
        _locked(shell, build, source, make)


@contextmanager
def exclusive(path: Path, waiting: str) -> Iterator[None]:
    """Hold the lock file `path` (made if missing); print `waiting` when
    another process holds it and wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(waiting, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _locked(shell: Shell, build: Build, source: Source, make: Make) -> None:
    if build.done():
        print(f"build {build.label}: cached ({build.shown})", flush=True)
        return
    # before the build directory: it may live inside the source tree
    src = source()
    if not shell.dry_run:
        if build.out.exists():
            shutil.rmtree(build.out)
        build.out.mkdir(parents=True)
    start = time.monotonic()
    if not make(src, build.out):
        return
    elapsed = time.monotonic() - start
    (build.out / DONE).write_text(f"{elapsed:.1f}\n")
    print(f"build {build.label}: done in {elapsed:.0f} s ({build.product})", flush=True)

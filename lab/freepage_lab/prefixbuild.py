"""Build every prefix of a kernel patch stack: each patch must build on its own.

One source tree, hard-linked from the pristine base, gets the patches one at
a time; after each, every requested arch is rebuilt incrementally in its own
build directory (a direct child of the tree, so ccache serves what the patch
did not change). The config is merged again from the fragments after each
patch, so options a patch adds are turned on from that patch on. Where a
patch adds or changes a KUnit suite (mm/tests/), the UML kernel runs its
built-in suites and every one must pass.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import buildcache, kernel, kunit, paths
from .shell import LabError, Shell, StageResult, timed

ARCHES = ("um", "x86_64")
KUNIT_TIMEOUT_S = 300


@dataclass(frozen=True)
class Step:
    """One patch of the stack and the series it belongs to."""

    series: str
    patch: Path

    @property
    def label(self) -> str:
        return f"{self.series}/{self.patch.name}"


def steps(queue: kernel.Queue) -> list[Step]:
    out = []
    for q in kernel.stack(queue):
        out += [Step(q.name, f) for f in kernel.Series.load(q.patch_dir).files]
    return out


def touches_kunit(patch: Path) -> bool:
    """Whether a patch adds or changes a KUnit suite of the series."""
    return re.search(r"^\+\+\+ b/mm/tests/", patch.read_text(errors="replace"), re.M) is not None


def _configure(shell: Shell, src: Path, out: Path, arch: str, first: bool) -> None:
    spec = kernel.BuildSpec(arch)
    cenv = buildcache.ccache_env()
    if first:
        base_target = kernel.BASE_CONFIG
        shell.run(kernel.make_argv(src, out, arch, base_target, ccache=cenv is not None), env=cenv,
                  log=out / "config.log", what=f"make {base_target}")
    shell.run([src / "scripts" / "kconfig" / "merge_config.sh", "-m", "-O", out,
               out / ".config", *spec.fragments()], cwd=src, log=out / "merge.log",
              what="merge config fragments")
    shell.run(kernel.make_argv(src, out, arch, "olddefconfig", ccache=cenv is not None), env=cenv,
              log=out / "olddefconfig.log", what="make olddefconfig")


def _make(shell: Shell, src: Path, out: Path, arch: str, label: str) -> None:
    cenv = buildcache.ccache_env()
    argv = kernel.make_argv(src, out, arch, jobs=os.cpu_count() or 2, ccache=cenv is not None)
    log = out / "build.log"
    try:
        shell.run(argv, env=cenv, log=log, what=f"build {arch}")
    except LabError as exc:
        errors = [ln for ln in log.read_text(errors="replace").splitlines()
                  if "error" in ln.lower()][:15] if log.exists() else []
        raise LabError(f"{label} does not build for {arch}: see {log}\n" + "\n".join(errors)) from exc


def run_kunit(shell: Shell, out: Path, label: str) -> str:
    """Boot the UML kernel until its built-in KUnit suites ran; all must pass."""
    argv = [str(out / "linux"), "mem=512M", "kunit.enable=1", "kunit_shutdown=halt",
            "con=null", "con0=fd:0,fd:1"]
    shell.show(argv)
    if shell.dry_run:
        return "dry run"
    log = out / "kunit.log"
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=KUNIT_TIMEOUT_S, start_new_session=True)
        text = proc.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace")
        log.write_text(text)
        raise LabError(f"{label}: KUnit did not finish in {KUNIT_TIMEOUT_S} s; see {log}") from exc
    log.write_text(text)
    res = kunit.parse(text.splitlines())
    if not res.ok:
        said = "".join(f"\n  {case}: " + " / ".join(lines)
                       for case, lines in res.diagnostics.items())
        raise LabError(f"{label}: KUnit failed: {', '.join(res.failed) or 'no suite ran'}; "
                       f"see {log}{said}")
    done = ", ".join(f"{name} {s['pass']}/{s['total']}" for name, s in sorted(res.suites.items()))
    return done + "".join(f"; skipped {case} ({why})" for case, why in sorted(res.skipped.items()))


def first_step(todo: list[Step], start: str) -> int:
    """The index in `todo` of `start`: a 1-based number or a unique part of a label."""
    if start.isdigit():
        if not 1 <= int(start) <= len(todo):
            raise LabError(f"--from {start}: the stack has patches 1 to {len(todo)}")
        return int(start) - 1
    hits = [i for i, step in enumerate(todo) if start in step.label]
    if len(hits) != 1:
        names = "\n  ".join(todo[i].label for i in hits)
        raise LabError(f"--from {start!r} names {len(hits)} patches of the stack"
                       + (f":\n  {names}" if hits else ""))
    return hits[0]


def build_each(shell: Shell, queue: kernel.Queue, arches: tuple[str, ...] = ARCHES,
               with_kunit: bool = True, start: str | None = None) -> StageResult:
    """Apply the stack of `queue` one patch at a time and build each prefix.

    With `start`, the patches before it are applied without a build (a run
    that already built them need not do so again); builds begin there."""
    first = first_step(steps(queue), start) if start else 0
    finish = timed(f"build each patch of {queue.name} and what it requires ({', '.join(arches)})"
                   + (f" from patch {first + 1}" if first else ""))
    base = kernel.base_tree(shell)
    src = paths.cache_dir() / "prefix" / kernel.base_version(shell)
    if shell.dry_run:
        return _build_each(shell, queue, arches, with_kunit, base, src, finish, first)
    # one tree for every worktree sharing the cache: a second run waits
    # instead of deleting the tree under the first one's compiler
    with buildcache.exclusive(src.with_name(src.name + ".lock"),
                              f"build-each: waiting for another build-each using {src}"):
        return _build_each(shell, queue, arches, with_kunit, base, src, finish, first)


def _build_each(shell: Shell, queue: kernel.Queue, arches: tuple[str, ...], with_kunit: bool,
                base: Path, src: Path, finish: Callable[..., StageResult],
                first: int = 0) -> StageResult:
    todo = steps(queue)
    if src.exists() and not shell.dry_run:
        shutil.rmtree(src)
    if not shell.dry_run:
        src.parent.mkdir(parents=True, exist_ok=True)
    shell.run(["cp", "-al", base, src], what="link base tree")
    # what the arches need to run on this host comes first, as in every
    # build of theirs (kernel.with_platform); it touches only their arch
    for arch in arches:
        for patch in kernel.with_platform(arch, kernel.Series.empty()).files:
            shell.run(["patch", "-p1", "-N", "-s", "--no-backup-if-mismatch", "-d", src,
                       "-i", patch], what=f"platform patch {patch.name} does not apply")
    outs = {arch: src / f"{arch}-prefix-build" for arch in arches}
    for out in outs.values():
        if not shell.dry_run:
            out.mkdir(parents=True)
    start = time.monotonic()
    for i, step in enumerate(todo):
        shell.run(["patch", "-p1", "-N", "-s", "--no-backup-if-mismatch", "-d", src,
                   "-i", step.patch], what=f"{step.label} does not apply")
        if i < first:
            continue
        line = [f"[{i + 1}/{len(todo)}] {step.label}:"]
        try:
            for arch in arches:
                t0 = time.monotonic()
                _configure(shell, src, outs[arch], arch, first=i == first)
                _make(shell, src, outs[arch], arch, step.label)
                line.append(f"{arch} {time.monotonic() - t0:.0f} s")
            if with_kunit and "um" in arches and (touches_kunit(step.patch) or i == len(todo) - 1):
                line.append("kunit " + run_kunit(shell, outs["um"], step.label))
        except LabError as exc:
            return finish("failed", f"first failing patch: {step.label}\n{exc}")
        print(" ".join(line), flush=True)
    built = f"patches {first + 1}-{len(todo)} of {len(todo)}" if first else f"{len(todo)} patches"
    return finish("ok", f"{built}, every prefix builds ({', '.join(arches)}) "
                  f"in {time.monotonic() - start:.0f} s")

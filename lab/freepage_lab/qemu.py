"""The QEMU side of the lab: pristine base, patch series (qemu/), cached builds.

The twin of kernel.py. The stock baseline is Debian's qemu-system-x86 from
bookworm-backports (QEMU 10.0); the freepage variants run a build of the
same QEMU release with every series of qemu/ applied (QUEUES, in order).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import buildcache, patchqueue, paths
from .patchqueue import Queue, Series
from .runners import QEMU_FIRMWARE_DIRS, STOCK_QEMU
from .shell import LabError, Shell, StageResult, timed

# Debian's qemu source package in bookworm-backports; the +ds orig tarball
# is pristine upstream QEMU minus the firmware blobs Debian builds itself.
BASE_VERSION = "10.0.2+ds"
BASE_TARBALL = f"qemu_{BASE_VERSION}.orig.tar.xz"
BASE_SHA256 = "0901da33844a331bf8b3602b9c1fbd178e60b737c8e3ade678255bd090c9b9f1"
BASE_URL = f"http://deb.debian.org/debian/pool/main/q/qemu/{BASE_TARBALL}"
BASE_DIRNAME = "qemu-10.0.2"

CONFIGURE_FLAGS = (
    "--target-list=x86_64-softmmu",
    "--disable-docs",
    "--disable-install-blobs",
    "--disable-tools",
    "--disable-guest-agent",
    # PATH may hold another python (pyenv); meson's venv wants Debian's
    "--python=/usr/bin/python3",
)

BINARY_NAME = "qemu-system-x86_64"

# The queue's qtest (libqos): QEMU's own test of the device, extended by
# the queue; built in the build directory of the QEMU it tests
QTEST_NAME = "virtio-balloon-test"
# per test case: the slowest, oversize inflate, maps 1000 x 4 GiB
QTEST_CASE_TIMEOUT_S = 120

# QEMU's own migration tests, on the pristine build and on the patched one:
# the patched build must pass every case the pristine one passes.  Not the
# whole set (30-80 s a case on 2 busy cores): precopy, postcopy (plain,
# with preempt, recovered after a failure), multifd with each zero page
# detection (a migration to a file, precopy/file/mapped-ram, took 81 s)
MIGRATION_TEST = "migration-test"
MIGRATION_TEST_CASES = (
    "/x86_64/migration/precopy/unix/plain",
    "/x86_64/migration/postcopy/plain",
    "/x86_64/migration/postcopy/preempt/plain",
    "/x86_64/migration/postcopy/recovery/plain",
    "/x86_64/migration/multifd/tcp/plain/zero-page/legacy",
    "/x86_64/migration/multifd/tcp/plain/zero-page/none",
)
# the queue's own cases (qemu/hint-during-pass, qemu/skip-unpopulated), which
# only the patched build has
MIGRATION_TEST_QUEUE_CASES = ("/x86_64/migration/precopy/free-page-hint/",
                              "/x86_64/migration/skip-unpopulated/")
MIGRATION_TEST_CASE_TIMEOUT_S = 300
# the pristine build's passed cases, kept in its build directory: the same
# source and test every time, so a warm run does not run them again
PRISTINE_PASSED = "migration-test-passed.json"


def cache_root() -> Path:
    return paths.cache_dir() / "qemu"


# --------------------------------------------------------------------------
# Pristine base
# --------------------------------------------------------------------------

def tarball(shell: Shell) -> Path:
    """The orig tarball, downloaded once from Debian's pool and checked."""
    dest = cache_root() / "dist" / BASE_TARBALL
    if dest.is_file():
        if sha256_file(dest) != BASE_SHA256:
            raise LabError(f"{dest}: sha256 mismatch (want {BASE_SHA256}); remove it")
        return dest
    part = dest.with_suffix(".part")
    shell.run(["curl", "-sSfL", "--create-dirs", "-o", part, BASE_URL],
              what=f"download {BASE_TARBALL}")
    if shell.dry_run:
        return dest
    got = sha256_file(part)
    if got != BASE_SHA256:
        part.unlink()
        raise LabError(f"{BASE_URL}: sha256 {got}, want {BASE_SHA256} (as in the .dsc)")
    part.rename(dest)
    return dest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def edk2_placeholders(tree: Path) -> list[Path]:
    """The edk2 *.fd.bz2 files pc-bios/meson.build lists but the +ds tarball lacks.

    Meson wants them to exist even for a build that does not install
    blobs; empty bzip2 streams do (x86 guests boot SeaBIOS from -L).
    """
    build = tree / "pc-bios" / "meson.build"
    names = re.findall(r"'(edk2-[^']+\.fd)'", build.read_text()) if build.is_file() else []
    return [tree / "pc-bios" / f"{n}.bz2" for n in names]


EMPTY_BZIP2 = bytes.fromhex("425a683917724538509000000000")


def base_tree(shell: Shell) -> Path:
    """Extract the pristine source once (plus the edk2 placeholders)."""
    tree = cache_root() / "base" / BASE_DIRNAME
    marker = tree / ".freepage-extracted"
    if marker.exists() and marker.read_text().strip() == BASE_VERSION:
        return tree
    src = tarball(shell)
    if not shell.dry_run:
        if tree.exists():
            shutil.rmtree(tree)
        tree.parent.mkdir(parents=True, exist_ok=True)
    shell.run(["tar", "--no-same-owner", "-C", tree.parent, "-xf", src],
              what="extract QEMU source")
    if shell.dry_run:
        return tree
    for f in edk2_placeholders(tree):
        if not f.exists():
            f.write_bytes(EMPTY_BZIP2)
    marker.write_text(BASE_VERSION + "\n")
    return tree


# --------------------------------------------------------------------------
# Patch queue
# --------------------------------------------------------------------------

QUEUES = {
    # a migration fix on its own: the balloon's discards marked dirty
    "dirty-discard": Queue("dirty-discard", paths.QEMU_DIR),
    # bits 6/7 and the vhost-user front-end
    "device-init": Queue("device-init", paths.QEMU_DIR, ("dirty-discard",)),
    # free page hints applied between two host pages of a RAM pass, alone
    "hint-during-pass": Queue("hint-during-pass", paths.QEMU_DIR),
    # hinting with postcopy-ram, as a pair
    "postcopy-hint": Queue("postcopy-hint", paths.QEMU_DIR, ("hint-during-pass",)),
    # RFC, behind x-skip-unpopulated-ram
    "skip-unpopulated": Queue("skip-unpopulated", paths.QEMU_DIR,
                              ("hint-during-pass", "postcopy-hint"), rfc=True),
    # RFC, behind x-switchover-after-first-pass (its qtest is in
    # virtio-balloon-test, which device-init extends)
    "first-pass-switchover": Queue("first-pass-switchover", paths.QEMU_DIR,
                                   ("dirty-discard", "device-init", "hint-during-pass",
                                    "postcopy-hint", "skip-unpopulated"), rfc=True),
}
# the top series a QEMU build carries, with every series it requires
TOP = QUEUES["first-pass-switchover"]
BENCH_DIR = paths.QEMU_DIR / "bench"
# hash length of the series' index lines (patchqueue.work_tree())
ABBREV = 8


def stack(queue: Queue = TOP) -> list[Queue]:
    """The series to apply for `queue` (default: every series a QEMU build
    applies), in order, ending with it."""
    return patchqueue.stack(QUEUES, queue)


def load_series() -> Series:
    """The patches of every series a QEMU build applies, named relative to qemu/."""
    return Series.joined(stack())


def tree_path(series: Series) -> Path:
    h = hashlib.sha256(BASE_VERSION.encode() + b"\0")
    h.update((series.digest() if series.names else "vanilla").encode())
    return cache_root() / "src" / h.hexdigest()[:16]


def applied_tree(shell: Shell, series: Series) -> Path:
    """The base with the series applied, hard-linked and cached (see kernel.py)."""
    return patchqueue.applied_tree(shell, base_tree(shell), tree_path(series), series,
                                   "QEMU base tree")


def materialise(shell: Shell, dest: Path) -> None:
    """A git work tree: base commit = pristine source, then one commit per
    patch, each series ending at its tag (Queue.tag)."""
    patchqueue.work_tree(shell, base_tree(shell), dest, stack(),
                         f"base: qemu {BASE_VERSION} (Debian orig tarball)", "QEMU base tree", ABBREV)


def export_stack(shell: Shell, tree: Path) -> dict[str, list[str]]:
    """Write every series back from a work tree made by materialise()."""
    return patchqueue.export_stack(shell, tree, stack())


def checkpatch_problems(output: str) -> list[str]:
    """ERROR and WARNING lines of QEMU's checkpatch.pl (clean means none)."""
    return [ln for ln in output.splitlines() if re.search(r"(^|: )(ERROR|WARNING):", ln)]


def check(shell: Shell, queue: Queue) -> StageResult:
    """The series applies to the pristine base after the series it
    requires, and QEMU's checkpatch.pl finds no ERROR or WARNING in it."""
    base = base_tree(shell)

    def checkpatch(patch: Path) -> str:
        argv: list[str | os.PathLike[str]] = [base / "scripts" / "checkpatch.pl",
                                               "--no-summary", "--terse", patch]
        # not shell.run: checkpatch's exit code alone hides warnings
        shell.show(argv, base)
        if shell.dry_run:
            return ""
        proc = subprocess.run([str(a) for a in argv], cwd=base, capture_output=True, text=True,
                              check=False)
        bad = checkpatch_problems(proc.stdout + proc.stderr)
        if proc.returncode != 0 or bad:
            return f"{patch.name}:\n  " + "\n  ".join(bad or [proc.stdout.strip()])
        return ""

    return patchqueue.check(shell, base, stack(queue), checkpatch, f"pristine QEMU {BASE_VERSION}",
                            "QEMU base tree")


# --------------------------------------------------------------------------
# Builds
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class BuiltQemu:
    out_dir: Path
    binary: Path
    key: str


def build_key(series: Series, flags: tuple[str, ...] = CONFIGURE_FLAGS) -> str:
    h = hashlib.sha256(f"{BASE_VERSION}\0".encode())
    h.update((series.digest() if series.names else "vanilla").encode())
    for f in flags:
        h.update(f.encode() + b"\0")
    return h.hexdigest()[:16]


def configure_argv(src: Path, flags: tuple[str, ...] = CONFIGURE_FLAGS) -> list[str]:
    return [str(src / "configure"), *flags]


def build(shell: Shell, series: Series | None = None,
          extra_patches: tuple[str, ...] = ()) -> BuiltQemu:
    """Configure and build out of tree, or return the cached build.

    `extra_patches`: test-only patches from qemu/bench/, applied after
    every series (e.g. one that takes a fix back out, to show a test fails).

    The build directory is a direct child of the applied tree, so meson
    names sources "../hw/...": with ccache a series edit recompiles only
    the files it touched.
    """
    series = (load_series() if series is None else series).plus(BENCH_DIR, extra_patches)
    key = build_key(series)
    out = tree_path(series) / f"build-{key}"
    binary = out / BINARY_NAME
    cached = buildcache.Build("qemu", "QEMU", out, binary,
                              cache_root() / "build" / f"{key}.lock", binary)

    def make(src: Path, out: Path) -> bool:
        return _make(shell, series, src, out, binary)

    buildcache.build_once(shell, cached, lambda: applied_tree(shell, series), make)
    return BuiltQemu(out, binary, key)


def _make(shell: Shell, series: Series, src: Path, out: Path, binary: Path) -> bool:
    """Configure and build into `out`; False on a dry run (nothing built)."""
    env = buildcache.ccache_env() or {}
    if env:
        env = {**env, "CC": buildcache.cached_compiler("gcc"), "CXX": buildcache.cached_compiler("g++")}
    shell.run(configure_argv(src), cwd=out, env=env, log=out / "configure.log",
              what="configure QEMU")
    shell.run(["nice", "-n", "5", "ninja", "-C", out, BINARY_NAME], env=env,
              log=out / "build.log", what="build QEMU")
    if shell.dry_run:
        return False
    if not binary.exists():
        raise LabError(f"QEMU build produced no {binary}")
    # release tarballs do not build with -Werror: hold the series to it
    warned = series_warnings((out / "build.log").read_text(errors="replace"),
                             patched_files(series))
    if warned:
        raise LabError("QEMU build: warnings in files the series touches:\n  "
                       + "\n  ".join(warned[:10]))
    return True


# --------------------------------------------------------------------------
# qtest
# --------------------------------------------------------------------------

def qtest_binary(built: BuiltQemu, name: str = QTEST_NAME) -> Path:
    return built.out_dir / "tests" / "qtest" / name


def bundle_datadir(out_dir: Path) -> Path:
    """Where the build's QEMU looks for firmware: qemu-bundle/<datadir>.

    A qtest cannot pass -L, so Debian's firmware is linked there
    (link_firmware()).
    """
    config = (out_dir / "config-host.h").read_text(errors="replace")
    m = re.search(r'#define CONFIG_QEMU_DATADIR "([^"]+)"', config)
    if not m:
        raise LabError(f"{out_dir}/config-host.h: no CONFIG_QEMU_DATADIR")
    return out_dir / "qemu-bundle" / m.group(1).lstrip("/")


def link_firmware(out_dir: Path, dirs: tuple[Path, ...] = QEMU_FIRMWARE_DIRS) -> list[Path]:
    """Symlink the files of `dirs` (Debian's firmware) into the build's
    data directory where it has none of that name; returns the new links."""
    dest = bundle_datadir(out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted(d.iterdir()):
            link = dest / f.name
            if f.is_file() and not link.exists() and not link.is_symlink():
                link.symlink_to(f)
                made.append(link)
    return made


@dataclass(frozen=True)
class QtestCase:
    path: str
    status: str  # "ok", "failed", "skipped"
    output: str


def tap_status(output: str, path: str) -> str:
    """A test case's status from the TAP a glib test prints.

    A case whose process died (an abort in QEMU or in the test) printed
    no "ok" line for it: that is a failure too.
    """
    for line in output.splitlines():
        m = re.match(r"^(not ok|ok)\s+\d+\s+(\S+)(.*)$", line)
        if not m or m.group(2) != path:
            continue
        if m.group(1) == "not ok":
            return "failed"
        return "skipped" if re.search(r"#\s*SKIP", m.group(3), re.I) else "ok"
    return "failed"


def qtest_cases(shell: Shell, binary: Path, env: dict[str, str]) -> list[str]:
    out = shell.run([binary, "-l"], env=env, capture=True, what=f"list {binary.name} cases")
    return [ln.strip() for ln in out.splitlines() if ln.strip().startswith("/")]


def run_qtest_case(argv: list[str], env: dict[str, str], path: str,
                   timeout_s: float = QTEST_CASE_TIMEOUT_S) -> tuple[str, str]:
    """Run one case in a process group of its own: (status, output).

    Not shell.run: a failing case is a result, not an error.  Output goes
    to a file, not a pipe, and the group is killed afterwards: a test that
    died leaves its QEMU behind, which would hold a pipe open.
    """
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        output = out.read()
    if returncode is None:
        return "failed", output + f"\ntimed out after {timeout_s:.0f} s"
    return (tap_status(output, path) if returncode == 0 else "failed"), output


def build_qtest(shell: Shell, built: BuiltQemu, name: str) -> Path:
    """Build the qtest `name` in the build's tree (ninja target of the same
    configure) and link Debian's firmware where the build's QEMU finds it."""
    env = buildcache.ccache_env() or {}
    shell.run(["nice", "-n", "5", "ninja", "-C", built.out_dir, f"tests/qtest/{name}"],
              env=env, log=built.out_dir / f"build-{name}.log", what=f"build {name}")
    if shell.dry_run:
        return qtest_binary(built, name)
    # as for QEMU itself: no compiler warning in a file the series touches
    warned = series_warnings((built.out_dir / f"build-{name}.log").read_text(errors="replace"),
                             patched_files(load_series()))
    if warned:
        raise LabError(f"build {name}: warnings in files the series touches:\n  "
                       + "\n  ".join(warned[:10]))
    link_firmware(built.out_dir)
    return qtest_binary(built, name)


def run_qtest_cases(shell: Shell, built: BuiltQemu, binary: Path, paths_: list[str],
                    args: tuple[str, ...] = (),
                    timeout_s: float = QTEST_CASE_TIMEOUT_S) -> list[QtestCase]:
    """Run each case in its own process against the build (one case's
    abort does not hide the next); `args`: more arguments of the test."""
    run_env = {"QTEST_QEMU_BINARY": str(built.binary)}
    cases = []
    for path in paths_:
        argv = [str(binary), *args, "--tap", "-p", path]
        shell.show(argv)
        status, output = run_qtest_case(argv, {**os.environ, **run_env}, path, timeout_s)
        print(f"  {status:7} {path}", flush=True)
        cases.append(QtestCase(path, status, output))
    return cases


def write_qtest_log(log: Path, cases: list[QtestCase]) -> None:
    log.write_text("".join(f"=== {c.path}: {c.status}\n{c.output}\n" for c in cases))


def run_qtest(shell: Shell, built: BuiltQemu, name: str = QTEST_NAME) -> list[QtestCase]:
    """Build the qtest in the build's tree and run each of its cases."""
    binary = build_qtest(shell, built, name)
    if shell.dry_run:
        return []
    run_env = {"QTEST_QEMU_BINARY": str(built.binary)}
    cases = run_qtest_cases(shell, built, binary, qtest_cases(shell, binary, run_env))
    write_qtest_log(built.out_dir / f"{name}.log", cases)
    return cases


def qtest_stage(shell: Shell, extra_patches: tuple[str, ...] = ()) -> StageResult:
    """Build QEMU (cached) and its qtest, run every case: ok if none fails."""
    finish = timed("qtest qemu")
    try:
        built = build(shell, extra_patches=extra_patches)
        cases = run_qtest(shell, built)
    except LabError as exc:
        return finish("failed", str(exc))
    if shell.dry_run:
        return finish("dry-run")
    counts = {s: [c.path for c in cases if c.status == s] for s in ("ok", "failed", "skipped")}
    summary = (f"{QTEST_NAME}: {len(counts['ok'])} passed, {len(counts['failed'])} failed, "
               f"{len(counts['skipped'])} skipped")
    lines = [summary]
    for c in cases:
        if c.status == "skipped":
            lines.append(f"skipped {c.path}")
        elif c.status == "failed":
            tail = "\n    ".join(c.output.strip().splitlines()[-8:])
            lines.append(f"FAILED {c.path}:\n    {tail}")
    status = "failed" if counts["failed"] or not cases else "ok"
    return finish(status, "\n".join(lines), cases={c.path: c.status for c in cases})


def pristine_series() -> Series:
    """No patch: QEMU as released (built as the patched one, cached apart)."""
    return Series(paths.QEMU_DIR, ())


def migration_test_cases(shell: Shell, built: BuiltQemu, binary: Path) -> list[str]:
    """The chosen cases of migration-test, and the queue's own where the build has them."""
    run_env = {"QTEST_QEMU_BINARY": str(built.binary)}
    out = shell.run([binary, "--full", "-l"], env=run_env, capture=True,
                    what=f"list {binary.name} cases")
    listed = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("/")]
    missing = [c for c in MIGRATION_TEST_CASES if c not in listed]
    if missing:
        raise LabError(f"{binary}: no case {', '.join(missing)}")
    return [*MIGRATION_TEST_CASES,
            *(c for c in listed if c.startswith(MIGRATION_TEST_QUEUE_CASES))]


def migration_test_compare(pristine: dict[str, str], patched: dict[str, str]) -> list[str]:
    """What fails the stage: a case that passes on the pristine build but
    not on the patched one, and a case of the queue's own that does not pass."""
    bad = [f"{c}: {patched.get(c, 'not run')} on the patched build, ok on the pristine one"
           for c, s in pristine.items() if s == "ok" and patched.get(c) != "ok"]
    bad += [f"{c}: {s} (the queue's own case)" for c, s in patched.items()
            if c not in pristine and s != "ok"]
    return bad


def pristine_cases(shell: Shell, paths_: list[str]) -> dict[str, str]:
    """The status of `paths_` on pristine QEMU: built (cached) and run only
    for cases not kept from an earlier run (its passed cases are kept in its
    build directory: the same source and test every time)."""
    pristine = build(shell, series=pristine_series())
    binary = build_qtest(shell, pristine, MIGRATION_TEST)
    if shell.dry_run:
        return {}
    kept = pristine.out_dir / PRISTINE_PASSED
    passed = set(json.loads(kept.read_text())) if kept.is_file() else set()
    ran = run_qtest_cases(shell, pristine, binary, [c for c in paths_ if c not in passed],
                          ("--full",), MIGRATION_TEST_CASE_TIMEOUT_S)
    if ran:
        write_qtest_log(pristine.out_dir / f"{MIGRATION_TEST}.log", ran)
    passed |= {c.path for c in ran if c.status == "ok"}
    kept.write_text(json.dumps(sorted(passed)) + "\n")
    return {**{c: "ok" for c in paths_ if c in passed}, **{c.path: c.status for c in ran}}


def migration_test_stage(shell: Shell, extra_patches: tuple[str, ...] = (),
                         pristine: bool = False) -> StageResult:
    """QEMU's migration-test on the patched build: it passes every chosen
    case that passes on pristine QEMU, and the queue's own cases.  Pristine
    QEMU is built and run only for the chosen cases the patched build does
    not pass (to tell a regression from a case this host cannot run), or
    for all of them with `pristine` (cached as the patched build is)."""
    finish = timed("migration-test qemu")
    try:
        patched = build(shell, extra_patches=extra_patches)
        binary = build_qtest(shell, patched, MIGRATION_TEST)
        if shell.dry_run:
            if pristine:
                pristine_cases(shell, list(MIGRATION_TEST_CASES))
            return finish("dry-run")
        cases = run_qtest_cases(shell, patched, binary,
                                migration_test_cases(shell, patched, binary),
                                ("--full",), MIGRATION_TEST_CASE_TIMEOUT_S)
        write_qtest_log(patched.out_dir / f"{MIGRATION_TEST}.log", cases)
        after = {c.path: c.status for c in cases}
        ask = [c for c in MIGRATION_TEST_CASES if pristine or after.get(c) != "ok"]
        before = pristine_cases(shell, ask) if ask else {}
    except LabError as exc:
        return finish("failed", str(exc))
    # a chosen case the patched build passes needs no pristine run to pass
    compare = {**{c: "ok" for c in MIGRATION_TEST_CASES if after.get(c) == "ok"}, **before}
    bad = migration_test_compare(compare, after)
    own = [c for c in after if c not in MIGRATION_TEST_CASES]
    ok = sum(v == "ok" for v in after.values())
    lines = [f"{MIGRATION_TEST}: patched {ok}/{len(after)} passed ({len(own)} of the "
             f"queue's own); pristine "
             + (f"{sum(v == 'ok' for v in before.values())}/{len(before)} passed" if before
                else "not needed (the patched build passed every chosen case)")]
    for c in cases:
        if c.status != "ok":
            tail = "\n    ".join(c.output.strip().splitlines()[-8:])
            lines.append(f"{c.status.upper()} {c.path}:\n    {tail}")
    lines += [f"{c}: fails on pristine QEMU too (this host's, not the queue's)"
              for c, s in before.items() if s != "ok" and after.get(c) != "ok"]
    lines += [f"REGRESSION {b}" for b in bad]
    return finish("failed" if bad else "ok", "\n".join(lines), cases=after)


def patched_files(series: Series) -> set[str]:
    """Source files a series changes (from the patches' +++ lines)."""
    files = set()
    for patch in series.files:
        files.update(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(errors="replace"), re.M))
    return files


def series_warnings(log: str, files: set[str]) -> list[str]:
    """Compiler warnings in a build log that point into `files` ("../hw/x.c:12:3: warning")."""
    out = []
    for line in log.splitlines():
        m = re.match(r"^(?:\.\./)?(\S+?):\d+:(?:\d+:)? warning:", line)
        if m and m.group(1) in files:
            out.append(line)
    return out


def build_stage(shell: Shell) -> tuple[StageResult, BuiltQemu | None]:
    finish = timed("build qemu")
    try:
        built = build(shell)
    except LabError as exc:
        return finish("failed", str(exc)), None
    return finish("ok", str(built.binary)), built


def stock_version(binary: Path = STOCK_QEMU) -> tuple[int, int] | None:
    """(major, minor) of an installed QEMU, None if it is not there."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             check=False).stdout
    except OSError:
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None

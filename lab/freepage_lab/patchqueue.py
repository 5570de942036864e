"""What the kernel and QEMU patch queues share: series that apply on top of
each other, applying them to a pristine base (hard-linked, cached), the git
work tree to edit them in, exporting and checking them."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self, TypeVar

from .shell import LabError, Shell, StageResult, timed

APPLIED = ".freepage-applied"


@dataclass(frozen=True)
class Series:
    """A `series` file's patches (<directory>/series), in order."""

    directory: Path
    names: tuple[str, ...]

    @classmethod
    def load(cls, directory: Path) -> Self:
        series = directory / "series"
        if not series.exists():
            return cls(directory, ())
        names = []
        for raw in series.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if not (directory / line).is_file():
                raise LabError(f"{series}: lists {line}, which does not exist")
            names.append(line)
        return cls(directory, tuple(names))

    @property
    def files(self) -> list[Path]:
        return [self.directory / n for n in self.names]

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0")
            h.update(f.read_bytes())
        return h.hexdigest()

    @classmethod
    def joined(cls, queues: Sequence[Queue]) -> Self:
        """Every patch of `queues`, in the order they apply, named relative
        to their root (kernel/, qemu/)."""
        root = queues[-1].root
        names: list[str] = []
        for q in queues:
            rel = q.patch_dir.relative_to(root)
            names += [f"{rel}/{n}" for n in cls.load(q.patch_dir).names]
        return cls(root, tuple(names))

    def plus(self, directory: Path, names: Sequence[str]) -> Self:
        """This series, then the test-only patches `names` of `directory`."""
        for name in names:
            if not (directory / name).is_file():
                raise LabError(f"test-only patch {directory / name} does not exist")
        return type(self)(self.directory, self.names + tuple(
            os.path.relpath(directory / n, self.directory) for n in names))


@dataclass(frozen=True)
class Queue:
    """One patch series, <root>/<name>/patches, and the series it applies
    on top of, in order (its cover letter says so)."""

    name: str
    root: Path
    requires: tuple[str, ...] = ()
    # posted as a request for comments: "[RFC PATCH n/m]"
    rfc: bool = False

    @property
    def patch_dir(self) -> Path:
        return self.root / self.name / "patches"

    @property
    def tag(self) -> str:
        """The tag at the last commit of the series in a work tree."""
        return f"series/{self.name}"


Q = TypeVar("Q", bound=Queue)


def stack(queues: Mapping[str, Q], queue: Q) -> list[Q]:
    """The series to apply for `queue`, in order, ending with it."""
    return [queues[name] for name in queue.requires] + [queue]


def applied_tree(shell: Shell, base: Path, tree: Path, series: Series, what: str) -> Path:
    """`tree`: the pristine `base` with the series applied, made once.

    Hard-linked to the base (GNU patch replaces the files it changes, so
    the base stays pristine), hence cheap in time and disk; a lock keeps
    two processes from making the same tree at once.
    """
    if (tree / APPLIED).exists():
        return tree
    if shell.dry_run:
        _apply(shell, base, tree, series, what)  # prints the commands
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    with open(tree.parent / f"{tree.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (tree / APPLIED).exists():
            return tree
        if tree.exists():
            shutil.rmtree(tree)
        _apply(shell, base, tree, series, what)
        (tree / APPLIED).write_text("\n".join(series.names) + "\n")
    return tree


def _apply(shell: Shell, base: Path, tree: Path, series: Series, what: str) -> None:
    shell.run(["cp", "-al", base, tree], what=f"link {what}")
    for patch in series.files:
        shell.run(["patch", "-p1", "-N", "-s", "--no-backup-if-mismatch", "-d", tree, "-i", patch],
                  what=f"apply {patch.name}")


# who commits the patches of a work tree and sends the cover letters; as
# environment, which overrides every git config, so that the exporting
# user's does not show in the series
COMMITTER = {"GIT_COMMITTER_NAME": "freepage", "GIT_COMMITTER_EMAIL": "dev@freepage.invalid"}
# the base commit has a fixed author and dates, so that its hash (the
# base-commit of the cover letters) is the same in every work tree of the
# same base version
BASE_COMMIT = {**COMMITTER, "GIT_AUTHOR_NAME": COMMITTER["GIT_COMMITTER_NAME"],
               "GIT_AUTHOR_EMAIL": COMMITTER["GIT_COMMITTER_EMAIL"],
               "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z"}


BASE_TAG = "freepage-base"
CHECKPATCH_CACHE = ".checkpatch-camelcase.*"


def work_tree(shell: Shell, base: Path, dest: Path, queues: Sequence[Queue],
              base_subject: str, what: str, abbrev: int) -> None:
    """A git work tree at `dest`: base commit = pristine source, tagged
    BASE_TAG, then one commit per patch of `queues`; each series ends at
    its tag (Queue.tag).

    `abbrev`: the hash length of the index lines the series were exported
    with, kept in the tree's config: git's own default grows with the
    objects in the tree (rebases, gc) and a user's core.abbrev differs,
    and either would rewrite every patch, and every build key, on export.
    """
    if dest.exists() and any(dest.iterdir()):
        raise LabError(f"{dest} exists and is not empty; remove it or pick another dir")
    shell.run(["cp", "-a", f"{base}/.", dest], what=f"copy {what}")
    git: list[str | os.PathLike[str]] = ["git", "-C", dest]
    shell.run([*git, "init", "-q"], what="git init")
    shell.run([*git, "config", "core.abbrev", str(abbrev)], what="git config core.abbrev")
    # a commit made in the tree by hand (a new patch) is authored as the
    # series is, not as whoever edits it
    shell.run([*git, "config", "user.name", COMMITTER["GIT_COMMITTER_NAME"]],
              what="git config user.name")
    shell.run([*git, "config", "user.email", COMMITTER["GIT_COMMITTER_EMAIL"]],
              what="git config user.email")
    # no automatic repack in the background: after `git am` into a fresh
    # kernel tree it takes minutes of CPU
    shell.run([*git, "config", "gc.auto", "0"], what="git config gc.auto")
    # Debian's kernel tree ignores everything in its top .gitignore ("/*")
    shell.run([*git, "add", "-f", "-A"], what="git add")
    # checkpatch.pl caches what it learnt of the tree in the directory it
    # runs in (the base); the cache is not the source, and would change
    # the base commit, and every base-commit line of an export, with it
    shell.run([*git, "rm", "-q", "--cached", "--ignore-unmatch", CHECKPATCH_CACHE],
              what="git rm checkpatch's cache")
    shell.run([*git, "commit", "-q", "-m", base_subject], env=BASE_COMMIT, what="git commit base")
    shell.run([*git, "tag", BASE_TAG], what="git tag")
    for q in queues:
        series = Series.load(q.patch_dir)
        if series.files:
            shell.run([*git, "am", "-q", *series.files], env=COMMITTER, what=f"git am {q.tag}")
        shell.run([*git, "tag", "-f", q.tag], what=f"git tag {q.tag}")


COVER = "0000-cover-letter.patch"


def cover_text(cover: str) -> tuple[str, str] | None:
    """The subject (without the [PATCH n/m] tag, its folded lines joined) and
    the text of a cover letter."""
    subject = re.search(r"^Subject: \[(?:RFC )?PATCH[^\]]*\] (.*(?:\n[ \t].*)*)$", cover, re.M)
    body = re.search(r"\n\n(.*?)\n\S[^\n]* \(\d+\):\n", cover, re.S)
    if not subject or not body:
        return None
    return re.sub(r"\n[ \t]+", " ", subject.group(1)), body.group(1).rstrip("\n")


def carry_cover(old: str, new: str) -> str:
    """The fresh cover letter `new` with the subject and text of `old`.

    git format-patch writes placeholders; the cover letter's words (and
    numbers) live only in the patch queue, so they are carried over.
    """
    kept = cover_text(old)
    if kept is None or "*** SUBJECT HERE ***" not in new:
        return new
    subject, body = kept
    new = new.replace("*** SUBJECT HERE ***", subject, 1)
    return new.replace("*** BLURB HERE ***", body, 1)


def export(shell: Shell, tree: Path, directory: Path, start: str = BASE_TAG,
           end: str = "HEAD", rfc: bool = False) -> list[str]:
    """Write the tree's commits start..end back as the series in
    `directory`; the cover letter names the base (base-commit, and the
    prerequisite-patch-id of every commit between base and start).
    `rfc`: the subjects say "[RFC PATCH n/m]"."""
    # ask git first: a tree without the base tag must not cost the queue
    count = shell.run(["git", "-C", tree, "rev-list", "--count", f"{start}..{end}"],
                      capture=True, what=f"count commits {start}..{end} (tags in place?)").strip()
    old_cover = directory / COVER
    kept = old_cover.read_text() if old_cover.is_file() else ""
    if not shell.dry_run:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.patch"):
            old.unlink()
    if count == "0":
        names: list[str] = []
    else:
        # the cover letter is dated as its newest patch, not as the export
        dates = shell.run(["git", "-C", tree, "log", "--format=%at", f"{start}..{end}"],
                          capture=True, what="author dates").split()
        sent = {"GIT_COMMITTER_DATE": f"{max(map(int, dates))} +0000"} if dates else {}
        shell.run(["git", "-C", tree, "format-patch", "-q", "--cover-letter", f"--base={BASE_TAG}",
                   *(["--rfc"] if rfc else []), "-o", directory, f"{start}..{end}"],
                  env={**COMMITTER, **sent},
                  what="git format-patch")
        names = sorted(p.name for p in directory.glob("*.patch") if not p.name.startswith("0000-"))
        if kept and not shell.dry_run:
            (directory / COVER).write_text(carry_cover(kept, (directory / COVER).read_text()))
    if not shell.dry_run:
        (directory / "series").write_text("".join(n + "\n" for n in names))
    return names


def export_stack(shell: Shell, tree: Path, queues: Sequence[Queue]) -> dict[str, list[str]]:
    """Export every series of `queues` from a work tree made by
    work_tree(): each series is the commits up to its tag (the last one
    up to HEAD, so that new commits on top belong to it)."""
    out: dict[str, list[str]] = {}
    start = BASE_TAG
    commits: dict[str, list[str]] = {}
    for q in queues:
        end = "HEAD" if q is queues[-1] else q.tag
        before = [c for done in commits.values() for c in done]
        out[q.name] = export(shell, tree, q.patch_dir, start, end, q.rfc)
        commits[q.name] = commit_list(shell, tree, start, end)
        if not shell.dry_run and out[q.name]:
            keep = {c for r in q.requires for c in commits.get(r, [])}
            cover = q.patch_dir / COVER
            cover.write_text(only_prerequisites(cover.read_text(), before, keep))
        start = end
    return out


def commit_list(shell: Shell, tree: Path, start: str, end: str) -> list[str]:
    """The commits start..end, oldest first."""
    if shell.dry_run:
        return []
    return subprocess.run(["git", "-C", str(tree), "rev-list", "--reverse", f"{start}..{end}"],
                          capture_output=True, text=True, check=True).stdout.split()


def only_prerequisites(cover: str, before: list[str], keep: set[str]) -> str:
    """The cover letter without the prerequisite-patch-id lines of the
    commits outside `keep`: format-patch names every commit between the
    base and the series (`before`, oldest first, one line each in that
    order), but a series needs only those of the series it requires (one
    that applies to the pristine base alone names none).  Unchanged where
    the lines do not match `before` one for one."""
    lines = cover.splitlines(keepends=True)
    prereq = [i for i, ln in enumerate(lines) if ln.startswith("prerequisite-patch-id: ")]
    if len(prereq) != len(before):
        return cover
    drop = {i for i, c in zip(prereq, before) if c not in keep}
    return "".join(ln for i, ln in enumerate(lines) if i not in drop)


def check_applies(shell: Shell, base: Path, series: Series, what: str) -> None:
    """Every patch applies, in order, to a scratch copy of the pristine base
    (a LabError names the first that does not)."""
    if not series.names:
        return
    with tempfile.TemporaryDirectory(prefix="freepage-check-") as tmp:
        scratch = Path(tmp) / "tree"
        shell.run(["cp", "-al", base, scratch], what=f"link {what}")
        for patch in series.files:
            shell.run(["patch", "-p1", "-N", "-s", "--dry-run", "-d", scratch, "-i", patch],
                      what=f"{patch.name} does not apply")
            shell.run(["patch", "-p1", "-N", "-s", "--no-backup-if-mismatch",
                       "-d", scratch, "-i", patch], what=f"apply {patch.name}")


def check(shell: Shell, base: Path, queues: Sequence[Queue], checkpatch: Callable[[Path], str],
          base_name: str, what: str) -> StageResult:
    """The last series of `queues` applies to the pristine `base` after the
    others, and `checkpatch` (its problems with one patch, "" for none)
    finds nothing in its own patches."""
    queue = queues[-1]
    finish = timed(f"check {queue.name}")
    check_applies(shell, base, Series.joined(queues), what)
    own = Series.load(queue.patch_dir)
    problems = [p for p in map(checkpatch, own.files) if p]
    if problems:
        return finish("failed", "\n".join(problems))
    on = ", ".join(queue.requires) or base_name
    return finish("ok", f"{len(own.names)} patches apply on {on} and are checkpatch clean")

"""What the kernel and QEMU patch queues share: applying a series to a
pristine base (hard-linked, cached) and the git work tree to edit it in."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from .shell import LabError, Shell

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


# the base commit has fixed dates, so that its hash (the base-commit of the
# cover letters) is the same in every work tree of the same base version
BASE_DATE = {"GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z"}


def work_tree(shell: Shell, base: Path, dest: Path, groups: Sequence[tuple[str, Series]],
              base_subject: str, what: str) -> None:
    """A git work tree at `dest`: base commit = pristine source, tagged
    freepage-base, then one commit per patch; each group of patches (a
    series) ends at a tag of its name."""
    if dest.exists() and any(dest.iterdir()):
        raise LabError(f"{dest} exists and is not empty; remove it or pick another dir")
    shell.run(["cp", "-a", f"{base}/.", dest], what=f"copy {what}")
    git: list[str | os.PathLike[str]] = ["git", "-C", dest, "-c", "user.name=freepage",
                                         "-c", "user.email=dev@freepage.invalid"]
    shell.run([*git, "init", "-q"], what="git init")
    # Debian's kernel tree ignores everything in its top .gitignore ("/*")
    shell.run([*git, "add", "-f", "-A"], what="git add")
    shell.run([*git, "commit", "-q", "-m", base_subject], env=BASE_DATE, what="git commit base")
    shell.run([*git, "tag", "freepage-base"], what="git tag")
    for tag, series in groups:
        if series.files:
            shell.run([*git, "am", "-q", *series.files], what=f"git am {tag}")
        shell.run([*git, "tag", "-f", tag], what=f"git tag {tag}")


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

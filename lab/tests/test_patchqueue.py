"""Series that apply on top of each other: joined for a build, in a git work
tree with a tag per series, exported back, checked; an empty series on top
changes nothing of what is below it."""

import difflib
import re
import subprocess
from pathlib import Path

import pytest

from freepage_lab import patchqueue
from freepage_lab.patchqueue import Queue, Series
from freepage_lab.shell import LabError, Shell

GIT = ["git", "-c", "user.name=freepage", "-c", "user.email=dev@freepage.invalid"]


def git(tree: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(tree), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def queues(tmp_path: Path) -> dict[str, Queue]:
    """A pristine base and two series: `first` with no patches yet, `second`
    on top of it."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "hello.txt").write_text("hello\n")
    out = {"first": Queue("first", tmp_path / "root"),
           "second": Queue("second", tmp_path / "root", ("first",))}
    for q in out.values():
        q.patch_dir.mkdir(parents=True)
        (q.patch_dir / "series").write_text("")
    return out


def with_one_patch(tmp_path: Path, queues: dict[str, Queue]) -> Path:
    """`first` carries one patch (made in a work tree and exported);
    `second` stays empty. Returns the work tree."""
    tree = tmp_path / "tree"
    stack = patchqueue.stack(queues, queues["second"])
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tree, stack, "base", "base", 7)
    (tree / "hello.txt").write_text("hello, world\n")
    git(tree, "commit", "-q", "-a", "-m", "hello: greet the world")
    git(tree, "tag", "-f", "series/first")
    git(tree, "tag", "-f", "series/second")
    patchqueue.export_stack(Shell(quiet=True), tree, stack)
    return tree


def without_commit_ids(directory: Path) -> dict[str, str]:
    return {p.name: re.sub(r"^From [0-9a-f]{40} ", "From - ", p.read_text(), flags=re.M)
            for p in sorted(directory.iterdir())}


def test_an_empty_series_on_top_gets_its_tag_and_exports_as_an_empty_series_file(tmp_path, queues):
    with_one_patch(tmp_path, queues)
    first, second = queues["first"], queues["second"]
    assert Series.load(first.patch_dir).names == ("0001-hello-greet-the-world.patch",)
    assert sorted(p.name for p in second.patch_dir.iterdir()) == ["series"]
    assert (second.patch_dir / "series").read_text() == ""

    # a fresh work tree of the exported series: both tags at the one commit
    tree = tmp_path / "again"
    stack = patchqueue.stack(queues, second)
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tree, stack, "base", "base", 7)
    assert git(tree, "log", "--format=%s", "freepage-base..series/first") == "hello: greet the world"
    assert git(tree, "rev-parse", "series/first") == git(tree, "rev-parse", "series/second")

    # exported again: the same series, but for the commit ids of the From lines
    before = {q.name: without_commit_ids(q.patch_dir) for q in stack}
    names = patchqueue.export_stack(Shell(quiet=True), tree, stack)
    assert names == {"first": ["0001-hello-greet-the-world.patch"], "second": []}
    assert {q.name: without_commit_ids(q.patch_dir) for q in stack} == before


def test_an_export_is_the_same_whoever_exports_it_and_when(tmp_path, queues, monkeypatch):
    """Only the commit ids of the From lines may change: the cover letter's
    sender and date, and the hash length of the index lines, come from the
    series, not from the exporting user's git (a ~/.gitconfig with
    core.abbrev = 12 would rewrite every patch, and every build key)."""
    with_one_patch(tmp_path, queues)
    stack = patchqueue.stack(queues, queues["second"])
    before = {q.name: without_commit_ids(q.patch_dir) for q in stack}
    (tmp_path / "gitconfig").write_text("[core]\n\tabbrev = 12\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Someone Else")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "else@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "2030-01-01T00:00:00Z")
    tree = tmp_path / "elsewhere"
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tree, stack, "base", "base", 7)
    patchqueue.export_stack(Shell(quiet=True), tree, stack)
    after = {q.name: without_commit_ids(q.patch_dir) for q in stack}
    changed = [(name, f, line) for name, files in after.items() for f, text in files.items()
               for line in difflib.unified_diff(before[name].get(f, "").splitlines(),
                                                text.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert not changed, "\n".join(" ".join(c) for c in changed)


def test_joined_series_are_named_from_the_root_and_an_empty_one_keeps_the_digest(tmp_path,
                                                                                  queues):
    with_one_patch(tmp_path, queues)
    first, second = queues["first"], queues["second"]
    joined = Series.joined(patchqueue.stack(queues, second))
    assert joined.directory == first.root
    assert joined.names == ("first/patches/0001-hello-greet-the-world.patch",)
    assert all(f.is_file() for f in joined.files)
    # what build keys hash: an empty series on top changes nothing
    assert joined.digest() == Series.load(first.patch_dir).digest()


def test_test_only_patches_follow_the_series(tmp_path, queues):
    with_one_patch(tmp_path, queues)
    bench = tmp_path / "root" / "bench"
    bench.mkdir()
    (bench / "take-it-out.patch").write_text("")
    joined = Series.joined(patchqueue.stack(queues, queues["second"]))
    plus = joined.plus(bench, ["take-it-out.patch"])
    assert plus.names[-1] == "bench/take-it-out.patch"
    assert plus.files[-1] == bench / "take-it-out.patch"
    with pytest.raises(LabError, match="test-only patch .*/bench/absent.patch does not exist"):
        joined.plus(bench, ["absent.patch"])


def test_check_applies_what_a_series_requires_and_checks_only_its_own_patches(tmp_path, queues):
    with_one_patch(tmp_path, queues)
    seen: list[str] = []

    def checkpatch(patch: Path) -> str:
        seen.append(patch.name)
        return ""

    shell = Shell(quiet=True)
    res = patchqueue.check(shell, tmp_path / "base", patchqueue.stack(queues, queues["second"]),
                           checkpatch, "pristine base", "base")
    assert (res.name, res.status, seen) == ("check second", "ok", [])
    assert res.detail == "0 patches apply on first and are checkpatch clean"

    res = patchqueue.check(shell, tmp_path / "base", [queues["first"]],
                           lambda patch: f"{patch.name}: WARNING: no", "pristine base", "base")
    assert res.status == "failed"
    assert res.detail == "0001-hello-greet-the-world.patch: WARNING: no"


def test_check_names_a_patch_that_does_not_apply(tmp_path, queues):
    with_one_patch(tmp_path, queues)
    (tmp_path / "base" / "hello.txt").write_text("goodbye\n")
    with pytest.raises(LabError, match="0001-hello-greet-the-world.patch does not apply"):
        patchqueue.check(Shell(quiet=True), tmp_path / "base", [queues["first"]],
                         lambda patch: "", "pristine base", "base")


def test_export_carries_the_cover_letter_text() -> None:
    old = ("From 1 Mon Sep 17 00:00:00 2001\nSubject: [PATCH 00/16] mm: the title\n\n"
           "Numbers:\n\n| a | b |\n\nfreepage (16):\n  mm: one\n")
    new = ("From 2 Mon Sep 17 00:00:00 2001\nSubject: [PATCH 00/17] *** SUBJECT HERE ***\n\n"
           "*** BLURB HERE ***\n\nfreepage (17):\n  mm: one\n  mm: two\n")
    out = patchqueue.carry_cover(old, new)
    assert "Subject: [PATCH 00/17] mm: the title\n\nNumbers:\n\n| a | b |\n\nfreepage (17):" in out
    assert "***" not in out
    # nothing to carry: the fresh letter stays as git wrote it
    assert patchqueue.carry_cover("garbage", new) == new


@pytest.mark.parametrize("tag, title, kept", [
    # a folded subject is carried whole
    ("PATCH 0/5", "migration: a long title,\n folded", "migration: a long title, folded"),
    # an RFC series keeps its text too
    ("RFC PATCH 0/1", "migration: a title", "migration: a title"),
])
def test_export_carries_the_subject_whole(tag, title, kept) -> None:
    old = (f"From 1 Mon Sep 17 00:00:00 2001\nSubject: [{tag}] {title}\n\nText.\n\n"
           "freepage (5):\n  mm: one\n")
    new = (f"From 2 Mon Sep 17 00:00:00 2001\nSubject: [{tag}] *** SUBJECT HERE ***\n\n"
           "*** BLURB HERE ***\n\nfreepage (5):\n  mm: one\n")
    out = patchqueue.carry_cover(old, new)
    assert f"Subject: [{tag}] {kept}\n\nText.\n\n" in out


def test_an_rfc_series_is_exported_as_rfc(tmp_path, queues):
    with_one_patch(tmp_path, queues)
    stack = patchqueue.stack(queues, queues["first"])
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tmp_path / "t", stack,
                         "base", "base", 7)
    out = tmp_path / "out"
    patchqueue.export(Shell(quiet=True), tmp_path / "t", out, rfc=True)
    patch = (out / "0001-hello-greet-the-world.patch").read_text()
    assert "Subject: [RFC PATCH 1/1] hello: greet the world" in patch


def test_a_series_names_only_the_prerequisites_it_requires(tmp_path, queues):
    """`third` applies to the base alone: its cover letter names no
    prerequisite, although `first`'s patch comes before it in the tree;
    `second` requires `first` and names its patch."""
    queues["third"] = Queue("third", tmp_path / "root")
    queues["third"].patch_dir.mkdir(parents=True)
    queues["second"] = Queue("second", tmp_path / "root", ("first",))
    stack = [queues["first"], queues["second"], queues["third"]]
    tree = tmp_path / "tree"
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tree, stack, "base", "base", 7)
    for name, (path, text) in (("first", ("hello.txt", "hello, world\n")),
                               ("second", ("hello.txt", "hello, world!\n")),
                               ("third", ("other.txt", "other\n"))):
        (tree / path).write_text(text)
        git(tree, "add", path)
        git(tree, "commit", "-q", "-m", f"{name}: change")
        git(tree, "tag", "-f", f"series/{name}")
    patchqueue.export_stack(Shell(quiet=True), tree, stack)
    second = (queues["second"].patch_dir / patchqueue.COVER).read_text()
    third = (queues["third"].patch_dir / patchqueue.COVER).read_text()
    assert second.count("prerequisite-patch-id: ") == 1
    assert "prerequisite-patch-id: " not in third
    assert "base-commit: " in third


def test_the_base_commit_is_the_source_whatever_checkpatch_left_beside_it(tmp_path, queues):
    """checkpatch.pl writes its cache into the base tree it runs in: two
    work trees made before and after a check have the same base commit
    (every export's base-commit line names it)."""
    stack = patchqueue.stack(queues, queues["second"])
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tmp_path / "t1", stack,
                         "base", "base", 7)
    (tmp_path / "base" / ".checkpatch-camelcase.date.202611141256").write_text("cache\n")
    patchqueue.work_tree(Shell(quiet=True), tmp_path / "base", tmp_path / "t2", stack,
                         "base", "base", 7)
    assert (git(tmp_path / "t1", "rev-parse", "freepage-base")
            == git(tmp_path / "t2", "rev-parse", "freepage-base"))

#!/usr/bin/env python3
"""compare-dry-runs.py: the commands every scenario prints, in two trees, diffed.

Runs `freepage --dry-run run <scenario> --platform <p> [flags]` for every
scenario, platform (uml, qemu, arm64) and flag set (none, --vanilla,
--patched-qemu) in this tree and in a git worktree of an older revision
(default 9e8d853, the lab before harness.py), normalises the tree's path,
run directory stamps, the build cache and temporary paths
(freepage_lab/dryrun.py), and reports which runs print the same output,
which differ in messages only (an error's wording; same commands, same exit
code) and which differ in commands. Runs whose diffs are equal are listed
under one diff.

The older tree gets the older lab/ on this tree's committed kernel/, qemu/,
guest/ and vhost-user-balloon/, so that a series hash or a patch renamed
since then does not count as a difference of the lab; --whole-tree takes
the older revision as it was. Both trees use one fresh, empty build cache,
so what is already built on this machine does not change what is printed.

Usage (from the tree to compare, with the lab's venv):
    .venv/bin/python scripts/compare-dry-runs.py [--before REV] [--whole-tree]
        [--only SCENARIO] [--out DIR] [--quiet]
Exits 0 when every run prints the same commands, 1 when one differs.
docs/lab.md lists the differences that are meant, and why.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this tree's lab: what a dry run is, and the scenarios there are
sys.path.insert(0, str(ROOT / "lab"))
dryrun = importlib.import_module("freepage_lab.dryrun")
registry = importlib.import_module("freepage_lab.scenarios").registry


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def older_tree(rev: str, dest: Path, whole_tree: bool) -> None:
    """A worktree at `rev`; unless whole_tree, with this tree's inputs besides lab/."""
    if whole_tree:
        git("worktree", "add", "--detach", str(dest), rev)
        return
    git("worktree", "add", "--detach", str(dest), "HEAD")
    git("rm", "-r", "-q", "lab", cwd=dest)
    git("checkout", rev, "--", "lab", cwd=dest)


def dry_run(tree: Path, cache: Path, args: list[str]) -> str:
    """One dry run's normalised output: commands and errors, stdout, exit code."""
    env = dict(os.environ, PYTHONPATH=str(tree / "lab"), FREEPAGE_CACHE=str(cache))
    env.pop("FREEPAGE_RUNS", None)
    proc = subprocess.run([sys.executable, "-m", "freepage_lab.cli", *args], cwd=tree,
                          env=env, capture_output=True, text=True, check=False)
    text = f"{proc.stderr}{proc.stdout}exit {proc.returncode}\n"
    return dryrun.normalise(text, tree, cache)


def changed_lines(old: str, new: str) -> str:
    """The lines only one side has, "-" before, "+" now, in diff order."""
    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
    return "\n".join(ln for ln in diff
                     if ln[:1] in "+-" and not ln.startswith(("---", "+++")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="9e8d853", help="the older revision (default 9e8d853)")
    p.add_argument("--whole-tree", action="store_true",
                   help="the older revision's kernel/, qemu/, ... too, not only its lab/")
    p.add_argument("--only", action="append", default=[], help="only this scenario (repeatable)")
    p.add_argument("--out", type=Path, help="write each run's two outputs here")
    p.add_argument("--quiet", action="store_true", help="counts only, no diffs")
    args = p.parse_args()

    if not args.whole_tree and git("status", "--porcelain", "--", ".", ":!lab").strip():
        print("note: changes outside lab/ that are not committed are not in the older tree",
              file=sys.stderr)
    scenarios = args.only or sorted(registry())
    # diff text -> runs; commands (and exit code) differ, or only messages
    groups: dict[str, dict[str, list[str]]] = {"commands": defaultdict(list),
                                               "messages": defaultdict(list)}
    identical = 0
    with tempfile.TemporaryDirectory(prefix="freepage-dryrun-") as tmp:
        before = Path(tmp) / "before"
        older_tree(args.before, before, args.whole_tree)
        try:
            for scenario, platform, flags in dryrun.matrix(scenarios):
                argv = dryrun.argv(scenario, platform, flags)
                name = dryrun.label(scenario, platform, flags)
                old = dry_run(before, Path(tmp) / "cache", argv)
                new = dry_run(ROOT, Path(tmp) / "cache", argv)
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / f"{name}.before").write_text(old)
                    (args.out / f"{name}.now").write_text(new)
                if old == new:
                    identical += 1
                    continue
                kind = ("messages" if dryrun.commands(old) == dryrun.commands(new)
                        and old.splitlines()[-1] == new.splitlines()[-1] else "commands")
                groups[kind][changed_lines(old, new)].append(name)
        finally:
            git("worktree", "remove", "--force", str(before))
    counts = {kind: sum(len(runs) for runs in g.values()) for kind, g in groups.items()}
    if not args.quiet:
        n = 0
        for kind, g in groups.items():
            for diff, runs in sorted(g.items(), key=lambda item: item[1][0]):
                n += 1
                print(f"== difference {n} ({kind}): {len(runs)} runs: {' '.join(runs)}")
                print(diff)
    total = identical + sum(counts.values())
    print(f"{total} dry runs against {args.before}: {identical} identical, "
          f"{counts['messages']} differ in messages only, "
          f"{counts['commands']} differ in commands "
          f"({len(groups['commands'])} distinct diffs)")
    return 0 if counts["commands"] == 0 else 1

if __name__ == "__main__":
    sys.exit(main())

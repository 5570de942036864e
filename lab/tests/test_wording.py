"""scripts/check-wording.sh: tracked files name no session, stop or issue numbers.

The script is run on small git repositories made for each test, to show
what it flags and what it lets through, and on this repository.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check-wording.sh"


def check_wording(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def git_repo(tmp_path: Path, files: dict[str, str]) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True, capture_output=True)
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    subprocess.run(["git", "add", "--", *files], cwd=repo, check=True)
    return repo


# Hits are joined from two parts at run time, so that this file itself
# holds none.
HITS = [
    ("fixed in session", " 3"),
    ("found in Session", " 13"),
    ("the CI of stop", " 16 failed"),
    ("a fix (issue", " 13)"),
    ("the goals of issues", " 11 and 12"),
    ("what this", " session changed"),
    ("see #", "12 for the details"),
    ("the session", "-10 run"),
]
SESSION_3 = "fixed in session" + " 3"

CLEAN = [
    "an SSH session, a vhost-user session",
    "the stop-and-copy phase; stop the guest; issue a flush",
    "proposed to the virtio TC (virtio-spec issue #244)",
    "bits 6 and 7 (virtio-spec issues #244, #242)",
    "Oops: Bad pagetable: 000e [#1] SMP",
    "Linux version 6.12.117 (root@vm) #1 SMP PREEMPT",
    'color = "#1f77b4"',
]


def test_a_session_number_fails_with_file_and_line(tmp_path):
    repo = git_repo(tmp_path, {"docs/notes.md": f"# Notes\n\n{SESSION_3}\n"})
    result = check_wording(repo)
    assert result.returncode == 1, result
    assert result.stdout.splitlines() == [f"docs/notes.md:3: {SESSION_3}"]


@pytest.mark.parametrize("parts", HITS, ids=lambda parts: "".join(parts))
def test_each_pattern_fails(tmp_path, parts):
    result = check_wording(git_repo(tmp_path, {"a.txt": f"x\n{''.join(parts)}\ny\n"}))
    assert result.returncode == 1, result
    assert result.stdout.startswith("a.txt:2: "), result


def test_ordinary_wording_passes(tmp_path):
    result = check_wording(git_repo(tmp_path, {"a.md": "\n".join(CLEAN) + "\n"}))
    assert result.returncode == 0, result
    assert result.stdout == ""


def test_a_reference_wrapped_after_the_tracker_name_passes(tmp_path):
    text = ("the bit (virtio-spec\n  issue " + "#244) and the bitmap (virtio-spec issue\n  "
            + "#242).\n")
    assert check_wording(git_repo(tmp_path, {"a.patch": text})).returncode == 0


def test_an_allowed_reference_does_not_hide_a_hit_on_its_line(tmp_path):
    line = "virtio-spec issue #244, and issue" + " 4"
    result = check_wording(git_repo(tmp_path, {"a.md": line + "\n"}))
    assert result.returncode == 1, result


def test_untracked_files_are_not_checked(tmp_path):
    repo = git_repo(tmp_path, {"a.md": "clean\n"})
    (repo / "b.md").write_text(SESSION_3 + "\n")
    assert check_wording(repo).returncode == 0


def test_this_repository_outside_kernel_is_clean():
    # kernel/ is checked by `make lint` (the whole repository); this test
    # keeps the rest clean whatever state the kernel series is in.
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    result = check_wording(REPO)
    assert result.returncode in (0, 1), result
    outside = [ln for ln in result.stdout.splitlines() if not ln.startswith("kernel/")]
    assert outside == []

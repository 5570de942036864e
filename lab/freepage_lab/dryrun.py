"""A dry run's commands as text that can be compared across trees and days.

`freepage --dry-run run <scenario> --platform <p>` prints every command a
real run would run. What differs between two trees or two days without the
commands differing is the tree's own path, the run directory's time stamp,
the build cache's path, temporary paths and the free TCP port a migration
listens on (the kernel picks it); `normalise()` replaces exactly those, so
that anything left in a diff is a different command or message.
`scripts/compare-dry-runs.py` compares two trees with it, and
`tests/test_dry_run_golden.py` pins the guests and daemons of a few runs
(`boots()`) to files in tests/data/dry-run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

PLATFORMS = ("uml", "qemu", "arm64")
# the flags a run's commands depend on besides scenario and platform
FLAG_SETS: tuple[tuple[str, ...], ...] = ((), ("--vanilla",), ("--patched-qemu",))

_STAMP = re.compile(r"/runs/\d{8}-\d{6}-")
_TEMP = re.compile(r"/tmp/(?:tmp|freepage-)[A-Za-z0-9_]+")
_PORT = re.compile(r"tcp:127\.0\.0\.1:\d+")
# a build cache key (kernel.py, qemu.py): a hash of the patches' contents
_KEY = re.compile(r"\b[0-9a-f]{16}\b")
# what starts a guest or its host side (a UML kernel, QEMU, the daemon),
# as opposed to a build step
_BOOT = re.compile(r"^\$ (\S*/linux |\S*qemu-system-\S+ |\S*/vhost-user-balloon )")


def argv(scenario: str, platform: str, flags: tuple[str, ...] = ()) -> list[str]:
    """The CLI arguments of one dry run."""
    return ["--dry-run", "run", scenario, "--platform", platform, *flags]


def matrix(scenarios: list[str]) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Every scenario on every platform with every flag set."""
    for scenario in scenarios:
        for platform in PLATFORMS:
            for flags in FLAG_SETS:
                yield scenario, platform, flags


def label(scenario: str, platform: str, flags: tuple[str, ...] = ()) -> str:
    """A file-name-safe name of one dry run: reclaim-uml, churn-qemu-patched-qemu."""
    return "-".join([scenario, platform, *(f.lstrip("-") for f in flags)])


def normalise(text: str, repo: Path, cache: Path, runs: Path | None = None) -> str:
    """`text` with the tree, cache and run paths, stamps and temporary
    names replaced by placeholders; nothing else changes."""
    if runs is not None:
        text = text.replace(str(runs), "<repo>/runs")
    text = text.replace(str(cache), "<cache>").replace(str(repo), "<repo>")
    text = _STAMP.sub("/runs/<stamp>-", text)
    text = _TEMP.sub("<tmp>", text)
    return _PORT.sub("tcp:127.0.0.1:<port>", text)


def commands(text: str) -> list[str]:
    """The commands of a dry run's output (the lines Shell.show() printed)."""
    return [line for line in text.splitlines() if line.startswith("$ ")]


def boots(text: str) -> list[str]:
    """The commands that start guests and daemons, build keys replaced:
    what a variant means (kernel, device, QEMU, daemon flags), and not
    what a patch's contents or the build steps are."""
    return [_KEY.sub("<key>", line) for line in commands(text) if _BOOT.match(line)]

"""The slow tests boot their guests through the harness, as the scenarios do.

    def test_boots(lab):
        ctx = lab.context("uml", patched=True)
        booted = lab.boot(ctx, "name", "populate --mib 32 --verify\\n", lab.BARE, mem_mib=256)

`lab.boot()` waits for the exit and fails on a non-zero exit code or a
kernel warning after boot (harness.boot); `lab.start()` yields the running
guest (harness.Running: its console, marks, daemon) for tests that talk to
it, and leaves the checks to the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from freepage_lab import harness
from freepage_lab.context import RunContext
from freepage_lab.shell import Shell


class Lab:
    """Contexts and boots for one test, in its tmp_path."""

    # a virtio balloon with free page reporting, no zeroing bits (QEMU);
    # UML: vhost-user-balloon with those flags
    PLAIN = harness.Variant("plain")
    # no balloon device at all
    BARE = harness.Variant("bare", balloon=False)
    # the daemon's and the device's defaults: the zeroing bits offered where
    # the context stands for them (UML: always)
    OFFERED = harness.Variant("offered", zeroing=None)

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def context(self, platform: str, **settings: Any) -> RunContext:
        """A run context in the test's directory; QEMU under TCG unless told."""
        settings.setdefault("accel", "tcg")
        return RunContext(shell=Shell(), run_dir=self.tmp_path, platform=platform, **settings)

    @contextmanager
    def start(self, ctx: RunContext, name: str, script: str, variant: harness.Variant = PLAIN,
              *, overrides: dict[str, Any] | None = None, run_with: Any = None,
              daemon: Any = None, **plan: Any) -> Iterator[harness.Running]:
        """Boot `variant` running `script`; `plan`: harness.Plan fields,
        `overrides`: GuestConfig fields."""
        with harness.start(ctx, variant, name, harness.Plan(script, **plan), run_with=run_with,
                           daemon=daemon, **(overrides or {})) as run:
            assert run is not None  # a test never runs dry
            yield run

    def boot(self, ctx: RunContext, name: str, script: str,
             variant: harness.Variant = PLAIN, **plan: Any) -> harness.Booted:
        """Boot, wait for the exit; a failed script or a kernel warning fails."""
        booted = harness.boot(ctx, variant, name, harness.Plan(script, **plan))
        assert booted is not None
        return booted


@pytest.fixture
def lab(tmp_path: Path) -> Lab:
    return Lab(tmp_path)

"""The migrate scenario's switchover capability: on for sources on the patched QEMU.

The QEMU series puts "no switchover before the first pass over RAM has
ended" behind the experimental capability x-switchover-after-first-pass,
off by default (stock QEMU's switchover).  The series' figures were
measured with it, so the scenario turns it on wherever the source runs
the patched QEMU, and never asks Debian's QEMU for it (which would refuse
a capability it does not know).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from freepage_lab import harness
from freepage_lab.context import RunContext
from freepage_lab.scenarios import migrate
from freepage_lab.scenarios.migrate import FIRST_PASS_CAP, MigrateParams, source_capabilities
from freepage_lab.shell import Shell


def context(tmp_path: Path, **settings: object) -> RunContext:
    return RunContext(shell=Shell(quiet=True), run_dir=tmp_path, platform="qemu", accel="tcg",
                      **settings)  # type: ignore[arg-type]


def first_pass(caps: list[dict]) -> bool | None:
    states = [c["state"] for c in caps if c["capability"] == FIRST_PASS_CAP]
    assert len(states) <= 1, caps
    return states[0] if states else None


def test_the_patched_qemu_variants_are_the_ones_that_get_the_capability(tmp_path) -> None:
    ctx = context(tmp_path)
    on_patched = {name for name, v in harness.family("migrate").items()
                  if harness.patched_qemu(ctx, v)}
    assert on_patched == {"no-hint", "hint", "hint-reported", "reported"}
    # --patched-qemu does not move the stock variants off Debian's QEMU
    ctx = context(tmp_path, patched_qemu=True)
    assert not harness.patched_qemu(ctx, harness.family("migrate")["stock-hint"])


@pytest.mark.parametrize("mode", migrate.MODES)
def test_the_source_on_the_patched_qemu_switches_over_after_the_first_pass(mode) -> None:
    p = MigrateParams()
    assert first_pass(source_capabilities(p, mode, patched_qemu=True)) is True
    # the rest is what both ends get
    assert [c for c in source_capabilities(p, mode, True)
            if c["capability"] != FIRST_PASS_CAP] == migrate.capabilities(p, mode)


def test_debian_qemu_is_not_asked_for_the_capability() -> None:
    assert first_pass(source_capabilities(MigrateParams(), "precopy", patched_qemu=False)) is None
    assert first_pass(migrate.capabilities(MigrateParams(), "precopy")) is None


def test_the_parameter_turns_it_off() -> None:
    p = MigrateParams(switchover_after_first_pass=False)
    assert first_pass(source_capabilities(p, "precopy", patched_qemu=True)) is False


class FakeQmp:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def execute(self, command: str, **arguments: object) -> object:
        self.calls.append((command, arguments))
        return {"status": "completed"} if command == "query-migrate" else {}


def test_only_the_source_gets_it(monkeypatch) -> None:
    qs, qd = FakeQmp(), FakeQmp()
    migrate.Migrate().migrate(MigrateParams(), "t", "precopy", qs, qd, 1,  # type: ignore[arg-type]
                              patched_qemu=True)
    caps = {name: [a["capabilities"] for c, a in q.calls if c == "migrate-set-capabilities"]
            for name, q in (("src", qs), ("dst", qd))}
    assert first_pass(caps["src"][0]) is True
    assert first_pass(caps["dst"][0]) is None

"""The migrate scenario's capabilities of the patched QEMU: on where it runs.

The QEMU series puts "no switchover before the first pass over RAM has
ended" behind the experimental capability x-switchover-after-first-pass
(the source's), and "do not send RAM that reads as zero on both sides"
behind x-skip-unpopulated-ram (both ends', the destination discards its
RAM first), both off by default (stock QEMU's behaviour).  The series'
figures were measured with them, so the scenario turns them on wherever
the patched QEMU runs, and never asks Debian's QEMU for them (which would
refuse a capability it does not know).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from freepage_lab import harness
from freepage_lab.context import RunContext
from freepage_lab.guest import Guest
from freepage_lab.scenarios import migrate
from freepage_lab.scenarios.migrate import (
    FIRST_PASS_CAP,
    ZERO_SKIP_CAP,
    MigrateParams,
    destination_capabilities,
    source_capabilities,
)
from freepage_lab.shell import LabError, Shell


def context(tmp_path: Path, **settings: object) -> RunContext:
    return RunContext(shell=Shell(quiet=True), run_dir=tmp_path, platform="qemu", accel="tcg",
                      **settings)  # type: ignore[arg-type]


def state(caps: list[dict], name: str) -> bool | None:
    states = [c["state"] for c in caps if c["capability"] == name]
    assert len(states) <= 1, caps
    return states[0] if states else None


def first_pass(caps: list[dict]) -> bool | None:
    return state(caps, FIRST_PASS_CAP)


def zero_skip(caps: list[dict]) -> bool | None:
    return state(caps, ZERO_SKIP_CAP)


def test_the_patched_qemu_variants_are_the_ones_that_get_the_capability(tmp_path) -> None:
    ctx = context(tmp_path)
    on_patched = {name for name, v in harness.family("migrate").items()
                  if harness.patched_qemu(ctx, v)}
    assert on_patched == {"no-hint", "hint", "hint-reported", "reported",
                          "qemu-patched", "qemu-patched-hint"}
    # --patched-qemu does not move the stock variants off Debian's QEMU
    ctx = context(tmp_path, patched_qemu=True)
    assert not harness.patched_qemu(ctx, harness.family("migrate")["stock-hint"])


@pytest.mark.parametrize("mode", migrate.MODES)
def test_the_source_on_the_patched_qemu_switches_over_after_the_first_pass(mode) -> None:
    p = MigrateParams()
    assert first_pass(source_capabilities(p, mode, patched_qemu=True)) is True
    # the rest is what both ends get, and the zero skip
    assert [c for c in source_capabilities(p, mode, True)
            if c["capability"] not in (FIRST_PASS_CAP, ZERO_SKIP_CAP)] == \
        migrate.capabilities(p, mode)


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


def capabilities_set(mode: str) -> dict[str, list]:
    """What one migration of the patched QEMU sets on each end, per call."""
    qs, qd = FakeQmp(), FakeQmp()
    migrate.Migrate().migrate(MigrateParams(), "t", mode, qs, qd, 1,  # type: ignore[arg-type]
                              patched_qemu=True)
    return {name: [a["capabilities"] for c, a in q.calls if c == "migrate-set-capabilities"]
            for name, q in (("src", qs), ("dst", qd))}


def test_only_the_source_gets_it(monkeypatch) -> None:
    caps = capabilities_set("precopy")
    assert first_pass(caps["src"][0]) is True
    assert first_pass(caps["dst"][0]) is None


def test_both_ends_get_the_zero_skip(monkeypatch) -> None:
    caps = capabilities_set("postcopy")
    assert zero_skip(caps["src"][0]) is True
    assert zero_skip(caps["dst"][0]) is True
    # the rest of the destination's is what both ends get
    assert [c for c in caps["dst"][0] if c["capability"] != ZERO_SKIP_CAP] == \
        migrate.capabilities(MigrateParams(), "postcopy")


def test_debian_qemu_is_not_asked_for_the_zero_skip() -> None:
    for caps in (source_capabilities(MigrateParams(), "precopy", patched_qemu=False),
                 destination_capabilities(MigrateParams(), "precopy", patched_qemu=False)):
        assert zero_skip(caps) is None


def test_the_parameter_turns_the_zero_skip_off_on_both_ends() -> None:
    p = MigrateParams(skip_unpopulated=False)
    assert zero_skip(source_capabilities(p, "precopy", patched_qemu=True)) is False
    assert zero_skip(destination_capabilities(p, "precopy", patched_qemu=True)) is False


class DroppingQmp:
    """A destination's QMP whose connection is gone: it refused the stream
    and is exiting."""

    def execute(self, command: str, **arguments: object) -> object:
        raise LabError("QMP: connection lost ([Errno 104] Connection reset by peer)")


def exiting_guest(tmp_path: Path, seconds: float) -> Guest:
    """A guest whose process is still running for `seconds`."""
    g = Guest("dst", ["sleep", str(seconds)], tmp_path / "dst.log", Shell(quiet=True))
    g.proc = subprocess.Popen(g.argv, start_new_session=True)
    return g


def test_a_destination_that_drops_its_qmp_while_it_exits_has_refused(tmp_path) -> None:
    """A QEMU closes its QMP socket before its process has ended: the
    connection lost while the process is still there is the exit, not an
    error (it failed a make test run)."""
    g = exiting_guest(tmp_path, 0.5)
    try:
        assert g.alive()
        assert migrate.destination_outcome(DroppingQmp(), g, 30) is None  # type: ignore[arg-type]
        assert not g.alive()
    finally:
        g.kill()


def test_a_destination_that_drops_its_qmp_and_stays_is_an_error(tmp_path,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(migrate, "EXIT_GRACE_S", 0.2)
    g = exiting_guest(tmp_path, 30)
    try:
        with pytest.raises(LabError, match="connection lost"):
            migrate.destination_outcome(DroppingQmp(), g, 30)  # type: ignore[arg-type]
    finally:
        g.kill()

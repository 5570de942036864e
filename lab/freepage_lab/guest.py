"""A running guest process: console capture, markers, timeouts, no orphans.

Every guest runs in its own session (process group).  Whatever happens to
the lab -- an exception, Ctrl-C, SIGTERM -- the group is killed, so UML's
helper processes and QEMU never outlive the run.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .initramfs import EXIT
from .procfs import group_members
from .shell import LabError, Shell

PANIC_RE = re.compile(r"Kernel panic - not syncing.*|BUG: .*|Oops: .*")
# what a console line says of the host when a guest dies of it: the one line
# a failure gives instead of the panic it ends in
HOST_CAUSES = (
    (re.compile(r"ptrace set fp regs failed, errno = 14\b"),
     "the host refused UML's FP registers (EFAULT): its XSAVE area is larger than the buffer "
     "this UML kernel passes (AMX hosts; `freepage host` shows the sizes); the lab's UML "
     "kernels carry kernel/platform/um for this"),
    (re.compile(r"must be not mounted noexec"),
     "UML cannot map its memory file executable: set TMPDIR to a directory without noexec "
     "(`freepage host`)"),
)

_live: set[Guest] = set()
_live_lock = threading.Lock()


def kill_all() -> None:
    with _live_lock:
        guests = list(_live)
    for g in guests:
        g.kill()


def _on_term(signum: int, _frame: object) -> None:
    kill_all()
    raise SystemExit(128 + signum)


atexit.register(kill_all)
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_term)


class GuestError(LabError):
    pass


@dataclass
class ConsoleLine:
    t: float  # host monotonic seconds
    text: str


class Guest:
    """One guest process with its console captured line by line."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, shell: Shell,
                 cwd: Path | None = None, interactive: bool = False) -> None:
        self.name = name
        # stdin is a pipe (QEMU -serial stdio: the guest's console input)
        self.interactive = interactive
        self.argv = [str(a) for a in argv]
        self.log_path = log
        self.shell = shell
        self.cwd = cwd
        self.lines: list[ConsoleLine] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._eof = False

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> Guest:
        self.shell.show(self.argv, self.cwd)
        if self.shell.dry_run:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.cwd,
                stdin=subprocess.PIPE if self.interactive else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise LabError(f"{self.name}: {self.argv[0]} not found (run `make deps`)") from exc
        self.started = time.monotonic()
        with _live_lock:
            _live.add(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w", encoding="utf-8") as log:
            for raw in self.proc.stdout:
                text = raw.decode(errors="replace").rstrip("\r\n")
                t = time.monotonic()
                log.write(f"[{t - self.started:9.3f}] {text}\n")
                log.flush()
                with self._cond:
                    self.lines.append(ConsoleLine(t, text))
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def send(self, text: str) -> None:
        """Type a line on the guest's console (an interactive guest's stdin)."""
        if self.shell.dry_run:
            return
        if self.proc is None or self.proc.stdin is None:
            raise LabError(f"{self.name}: not started as an interactive guest")
        try:
            self.proc.stdin.write(text.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise self.error(f"console input failed ({exc})") from exc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ends_within(self, timeout: float) -> bool:
        """Whether the process has ended or ends within `timeout` s. A QEMU
        closes its sockets while it exits: a lost QMP connection can come
        before the process is gone."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise LabError(f"{self.name} is not running")
        return self.proc.pid

    def kill(self) -> None:
        """SIGTERM the whole group, then SIGKILL what is left."""
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace)
                # the leader is gone; make sure no group member survived it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + 3
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._reader is not None:
            self._reader.join(timeout=2)
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> Guest:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    # -- console -------------------------------------------------------------
    def tail(self, n: int = 20) -> str:
        with self._cond:
            return "\n".join(f"    {ln.text}" for ln in self.lines[-n:])

    def host_cause(self) -> str:
        """What the console says of the host that made the guest fail, or ""."""
        with self._cond:
            texts = [ln.text for ln in self.lines]
        for rx, cause in HOST_CAUSES:
            if any(rx.search(text) for text in texts):
                return cause
        return ""

    def error(self, why: str) -> GuestError:
        """A GuestError carrying the console tail (and the host's part in it)."""
        cause = self.host_cause()
        return GuestError(f"{self.name}: {why}" + (f"\n  cause: {cause}" if cause else "")
                          + f"\n  last console lines (full log {self.log_path}):\n{self.tail()}")

    def wait_for(self, pattern: str, timeout: float,
                 start_index: int = 0) -> tuple[int, ConsoleLine, re.Match[str]]:
        """Block until a console line matches; fail on panic, exit or timeout."""
        if self.shell.dry_run:
            raise LabError("dry run: not waiting for the guest")
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = start_index
        with self._cond:
            while True:
                while i < len(self.lines):
                    line = self.lines[i]
                    m = rx.search(line.text)
                    if m:
                        return i, line, m
                    if PANIC_RE.search(line.text):
                        raise self.error(f"guest kernel failed ({line.text.strip()})")
                    i += 1
                if self._eof:
                    raise self.error(f"guest stopped before printing /{pattern}/ "
                                     f"(exit {self.proc.poll() if self.proc else '?'})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.error(f"timed out after {timeout:.0f} s waiting for /{pattern}/")
                self._cond.wait(timeout=min(left, 0.5))

    def wait_exit(self, timeout: float) -> int:
        """Wait for the init's exit marker and the process to end; return the script's rc."""
        _, _, m = self.wait_for(rf"^{EXIT} (\d+)", timeout)
        assert self.proc is not None
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise self.error("guest printed its exit marker but did not power off") from None
        return int(m.group(1))

    def json_records(self, prog: str | None = None) -> list[dict]:
        out = []
        with self._cond:
            lines = list(self.lines)
        for ln in lines:
            text = ln.text.strip()
            if not text.startswith('{"prog":'):
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                continue
            if prog is None or rec.get("prog") == prog:
                rec["_t"] = ln.t
                out.append(rec)
        return out

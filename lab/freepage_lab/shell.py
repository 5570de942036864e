"""Running external commands: print first, honour --dry-run, fail precisely."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class LabError(Exception):
    """A failure with a message precise enough to act on."""


@dataclass
class StageResult:
    """Outcome of one stage (build, boot, scenario...), kunit.py style."""

    name: str
    status: str  # "ok", "failed", "skipped", "dry-run"
    elapsed_s: float
    detail: str = ""
    data: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "dry-run", "skipped")


class Shell:
    """Prints every external command shell-quoted before it runs."""

    def __init__(self, dry_run: bool = False, quiet: bool = False) -> None:
        self.dry_run = dry_run
        self.quiet = quiet

    def show(self, argv: Sequence[str | os.PathLike[str]], cwd: Path | None = None) -> str:
        line = shlex.join(str(a) for a in argv)
        if cwd is not None:
            line = f"(cd {shlex.quote(str(cwd))} && {line})"
        if not self.quiet:
            print(f"$ {line}", file=sys.stderr, flush=True)
        return line

    def run(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        capture: bool = False,
        log: Path | None = None,
        what: str | None = None,
        input_bytes: bytes | None = None,
    ) -> str:
        """Run argv; raise LabError naming `what` and the output tail on failure.

        With `log`, output goes to that file (progress stays readable);
        with `capture`, stdout is returned.
        """
        self.show(argv, cwd)
        if self.dry_run:
            return ""
        full_env = None
        if env is not None:
            full_env = dict(os.environ)
            full_env.update(env)
        argv_s = [str(a) for a in argv]
        try:
            if log is not None:
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, "wb") as out:
                    proc = subprocess.run(
                        argv_s, cwd=cwd, env=full_env, stdout=out,
                        stderr=subprocess.STDOUT, input=input_bytes, check=False,
                    )
                if proc.returncode != 0:
                    raise LabError(
                        f"{what or argv_s[0]} failed (exit {proc.returncode}); "
                        f"last lines of {log}:\n{tail_file(log, 25)}"
                    )
                return ""
            proc = subprocess.run(
                argv_s, cwd=cwd, env=full_env, input=input_bytes, check=False,
                stdout=subprocess.PIPE if capture else None,
                stderr=subprocess.PIPE if capture else None,
            )
        except FileNotFoundError as exc:
            raise LabError(
                f"{what or argv_s[0]}: command not found: {argv_s[0]} "
                "(run `make deps` to install the host packages)"
            ) from exc
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace") if capture and proc.stderr else ""
            raise LabError(f"{what or argv_s[0]} failed (exit {proc.returncode}) {err.strip()}")
        return proc.stdout.decode(errors="replace") if capture else ""


def tail_file(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(lines[-n:])


def timed(name: str) -> Callable[..., StageResult]:
    """Start a stage's clock; the returned finisher makes its StageResult."""
    start = time.monotonic()

    def finish(status: str, detail: str = "", **data: object) -> StageResult:
        return StageResult(name, status, time.monotonic() - start, detail, dict(data))

    return finish

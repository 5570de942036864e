"""The host side for UML guests: the vhost-user-balloon daemon."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from . import buildcache, paths
from .shell import LabError, Shell


def source_key() -> str:
    """A digest of the daemon's sources: what its binary is built from."""
    h = hashlib.sha256()
    root = paths.BACKEND_DIR
    files = [root / "Cargo.toml", root / "Cargo.lock", *sorted((root / "src").rglob("*.rs"))]
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def binary(shell: Shell) -> Path:
    """The release binary of this tree's sources, built once per content.

    Worktrees share the cargo target directory (dependencies build once),
    so the binary it holds is whichever tree built last: each build is
    copied out to a directory of its own sources' key, and a guest always
    runs the daemon of the tree that boots it.
    """
    cache = paths.cache_dir()
    out = cache / "daemon" / source_key()
    exe = out / "vhost-user-balloon"
    target = cache / "cargo-target"

    def make(_src: Path, dest: Path) -> bool:
        shell.run(["make", "-s", "-C", paths.BACKEND_DIR, "build", f"CARGO_TARGET_DIR={target}"],
                  what="build vhost-user-balloon")
        if shell.dry_run:
            return False
        shutil.copy2(target / "release" / "vhost-user-balloon", dest / exe.name)
        return True

    # one lock for every key: they share the target directory
    build = buildcache.Build(label="vhost-user-balloon", what="daemon", out=out, product=exe,
                             lock=cache / "daemon" / ".lock", shown=exe)
    buildcache.build_once(shell, build, lambda: paths.BACKEND_DIR, make)
    return exe


class BalloonBackend:
    """Runs the daemon on a socket for one guest; stops it (and only it) afterwards."""

    def __init__(self, shell: Shell, sock: Path, log: Path, extra: list[str] | None = None) -> None:
        self.shell = shell
        self.socket = sock
        self.control = sock.with_suffix(".ctl")
        self.log = log
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self, exe: Path) -> list[str]:
        return [str(exe), "--socket-path", str(self.socket), "--control-socket",
                str(self.control), *self.extra]

    def start(self) -> None:
        argv = self.argv(binary(self.shell))
        self.shell.show(argv)
        if self.shell.dry_run:
            return
        for p in (self.socket, self.control):
            if p.exists():
                p.unlink()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise LabError(f"vhost-user-balloon exited (code {self.proc.returncode}); "
                               f"see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise LabError(f"vhost-user-balloon did not create {self.socket} within 10 s")
            time.sleep(0.05)

    def __enter__(self) -> BalloonBackend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request(self, cmd: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.control))
            s.sendall(json.dumps(cmd).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        return json.loads(buf)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.proc = None

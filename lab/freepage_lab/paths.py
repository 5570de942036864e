"""Where things live: the repository, the build cache, run directories."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNEL_DIR = REPO / "kernel"
# the zero tracking series (kernel.QUEUES names every series and its order)
PATCH_DIR = KERNEL_DIR / "never-zero-twice" / "patches"
CONFIG_DIR = KERNEL_DIR / "configs"
QEMU_DIR = REPO / "qemu"
GUEST_DIR = REPO / "guest"
BACKEND_DIR = REPO / "vhost-user-balloon"

BASE_PACKAGE = "linux-source-6.12"
BASE_TARBALL = Path("/usr/src/linux-source-6.12.tar.xz")


def cache_dir() -> Path:
    """Build cache shared by every clone on this machine (kernel builds are slow)."""
    env = os.environ.get("FREEPAGE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "freepage"


def runs_dir() -> Path:
    env = os.environ.get("FREEPAGE_RUNS")
    return Path(env) if env else REPO / "runs"

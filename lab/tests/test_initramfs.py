import shutil
import stat
import subprocess

import pytest

from freepage_lab import initramfs


def test_newc_lists_with_cpio(tmp_path):
    if not shutil.which("cpio"):
        pytest.skip("cpio not installed")
    data = initramfs.newc([
        initramfs.Entry("bin", stat.S_IFDIR | 0o755),
        initramfs.Entry("bin/hello", stat.S_IFREG | 0o755, b"#!/bin/sh\necho hi\n"),
        initramfs.Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
    ])
    assert len(data) % 4 == 0
    out = subprocess.run(["cpio", "-t", "-v"], input=data, capture_output=True, check=True)
    listing = out.stdout.decode()
    assert "bin/hello" in listing and "dev/console" in listing
    assert "5," in listing  # the console device node keeps its major number


def test_overlay_appends_run_script(tmp_path):
    base = tmp_path / "base.cpio"
    base.write_bytes(initramfs.newc([initramfs.Entry("x", stat.S_IFREG | 0o644, b"1")]))
    out = initramfs.with_script(base, "echo hi\n", tmp_path / "run.cpio")
    blob = out.read_bytes()
    assert blob.startswith(base.read_bytes())
    assert b"run.sh" in blob[len(base.read_bytes()):]


def test_init_prints_the_markers_the_host_waits_for():
    assert initramfs.BOOTED in initramfs.INIT
    assert initramfs.EXIT in initramfs.INIT

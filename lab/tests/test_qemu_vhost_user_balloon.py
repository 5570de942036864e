"""vhost-user-balloon behind QEMU: the Rust daemon serves an x86 guest.

The patched QEMU runs the daemon through vhost-user-balloon-pci, the
balloon's vhost-user front-end of qemu/device-init; guest RAM is a shared memfd
the daemon maps.
The guest writes 256 MiB to a tmpfs file, deletes it and forces a reporting
pass; the daemon discards what the guest reported, which the host sees as
blocks leaving the memfd.  At least 90% of the freed 256 MiB must go.
A background snapshot, which cannot see those discards, is refused.

Baseline, expected to fail: FREEPAGE_VHOST_USER_BASELINE=snapshot runs
the snapshot test on the patched QEMU with
qemu/bench/vhost-user-balloon-snapshot.patch (the refusal taken out).
"""

from __future__ import annotations

import os
import time

import pytest

from freepage_lab import guestshell, harness, kernel
from freepage_lab.initramfs import EVENT
from freepage_lab.procfs import deleted_file
from freepage_lab.runners import Qmp
from freepage_lab.shell import LabError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]

MIB = 1 << 20
FREED_MIB = 256
BASELINE = os.environ.get("FREEPAGE_VHOST_USER_BASELINE", "")


def guest_script() -> str:
    return "\n".join([
        "echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction",
        f"mount -o remount,size={FREED_MIB + 64}m /tmp",
        "head -c 8388608 /dev/zero | tr '\\000' '\\245' > /tmp/chunk",
        f"cat $(yes /tmp/chunk | head -n {FREED_MIB // 8}) > /tmp/fill",
        "rm /tmp/chunk",
        f"echo \"{EVENT} filled\"",
        "read go",
        "rm /tmp/fill",
        guestshell.flush_cmd(),
        f"echo \"{EVENT} freed\"",
        "read done",
    ]) + "\n"


def memfd_bytes(qemu_pid: int) -> int:
    """Allocated blocks of the guest's RAM: the memfd QEMU holds (deleted file)."""
    mem = deleted_file(qemu_pid)
    assert mem is not None, f"QEMU {qemu_pid} holds no memfd"
    return os.stat(mem).st_blocks * 512


def test_vhost_user_balloon_reclaims_freed_memory(lab) -> None:
    ctx = lab.context("qemu", patched=True)
    # the daemon's defaults, on the patched QEMU (vhost-user-balloon-pci)
    variant = harness.Variant("vhost-user", zeroing=None, vhost_user=True)
    with lab.start(ctx, "vub", guest_script(), variant, mem_mib=512, interactive=True) as run:
        g, backend = run.guest, run.backend
        assert backend is not None
        g.wait_for(rf"^{EVENT} filled", 300)
        filled = memfd_bytes(g.pid)
        g.send("go")
        g.wait_for(rf"^{EVENT} freed", 120)
        deadline = time.monotonic() + 30
        while True:
            now = memfd_bytes(g.pid)
            if filled - now >= 0.9 * FREED_MIB * MIB or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        counters = backend.request({"cmd": "get_counters"})
        g.send("done")
        assert run.wait_exit(60) == 0
    reclaimed = (filled - now) / (FREED_MIB * MIB)
    print(f"memfd: {filled / MIB:.0f} MiB after the fill, {now / MIB:.0f} MiB after the "
          f"reporting pass: {reclaimed:.0%} of the freed {FREED_MIB} MiB reclaimed; "
          f"daemon: {counters}")
    assert reclaimed >= 0.9


def test_vhost_user_balloon_refuses_a_background_snapshot(lab) -> None:
    """A background snapshot follows guest writes with userfaultfd write
    protection and does not see the daemon punch holes in the memfd: a
    page freed after the snapshot started would be saved as zero.  The
    front-end refuses the snapshot when it starts."""
    extra = ("vhost-user-balloon-snapshot.patch",) if BASELINE == "snapshot" else ()
    ctx = lab.context("qemu", patched=True, qemu_extra_patches=extra)
    variant = harness.Variant("vhost-user", zeroing=None, vhost_user=True)
    script = f"echo \"{EVENT} up\"\nread done\n"
    sock = lab.tmp_path / "vub.qmp"
    with lab.start(ctx, "vub-snap", script, variant, mem_mib=256, interactive=True,
                   overrides=dict(qmp_socket=sock)) as run:
        g = run.guest
        g.wait_for(rf"^{EVENT} up", 300)
        qmp = Qmp(sock)
        try:
            try:
                qmp.execute("migrate-set-capabilities",
                            capabilities=[{"capability": "background-snapshot", "state": True}])
            except LabError as exc:
                pytest.fail(f"this host cannot take a background snapshot of the guest's "
                            f"memfd, so the refusal cannot be shown: {exc}")
            qmp.execute("migrate", uri=f"exec:cat > {lab.tmp_path / 'snapshot'}")
            deadline = time.monotonic() + 120
            while True:
                info = qmp.execute("query-migrate")
                assert isinstance(info, dict)
                if info.get("status") in ("failed", "completed", "cancelled"):
                    break
                assert time.monotonic() < deadline, f"snapshot stuck: {info}"
                time.sleep(0.2)
        finally:
            qmp.close()
        g.send("done")
        assert run.wait_exit(60) == 0
    print(f"background snapshot: {info.get('status')}: {info.get('error-desc', '')}")
    assert info.get("status") == "failed", info
    assert "background snapshot" in info.get("error-desc", ""), info

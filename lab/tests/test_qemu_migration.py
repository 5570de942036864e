"""Zero means zero across a live migration (issue 10, hole 1).

A guest on the patched QEMU with free page reporting and bit 6
(VIRTIO_BALLOON_F_DEVICE_INIT_REPORTED, proposed, not allocated) holds
~600 MiB of non-zero data in a tmpfs.  The host migrates it at 30 MiB/s to a
second QEMU; once the first pass has sent the data, the guest frees it and
forces a reporting pass, so the source discards pages the destination
already holds with the old contents.  After the switchover, verified
populates on the destination (4k and THP) must read zeroes only: the pages
the guest now believes zero must have been sent again as zeroes.

The guest's own checks keep the test from passing vacuously: bit 6 must be
negotiated and reporting must have marked pages zero.

FREEPAGE_MIGRATION_BASELINE=stock runs the same test against Debian's QEMU
(no qemu/patches) with a guest that trusts reports
(virtio_balloon.assume_reported_zero=1): the configuration in which the
destination handed out stale data.  It is expected to fail.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from freepage_lab import kernel, knobs, qemu
from freepage_lab.context import RunContext
from freepage_lab.guest import Guest
from freepage_lab.initramfs import BOOTED, EVENT
from freepage_lab.runners import STOCK_QEMU, GuestConfig, QemuRunner, Qmp
from freepage_lab.scenarios.migrate import free_port
from freepage_lab.shell import Shell

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]

MIB = 1 << 20
BALLOON_BIT_DEVICE_INIT_REPORTED = 6
BASELINE = os.environ.get("FREEPAGE_MIGRATION_BASELINE", "")


@dataclass
class Plan:
    mem_mib: int = 1024
    fill_mib: int = 600
    verify_mib: int = 800
    bandwidth_mib_s: int = 30
    # keeps the migration from converging until the guest has freed its data
    churn_mib: int = 8


def guest_script(p: Plan) -> str:
    """Fill, wait for the host, free + report, wait for the host, verify."""
    balloon = ("for d in /sys/bus/virtio/devices/*; do "
               "[ \"$(cat $d/device)\" = 0x0005 ] && echo ${d##*/}; done | head -1")
    marked = "awk '/^pgzero_marked_reported /{print $2}' /proc/vmstat"
    features = knobs.VIRTIO_FEATURES.format(dev="$dev")
    return "\n".join([
        "echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction",
        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled",
        f"mount -o remount,size={p.fill_mib + 64}m /tmp",
        f"dev=$({balloon})",
        f"echo \"{EVENT} features $(cat {features})\"",
        f"tr '\\000' '\\245' < /dev/zero | head -c $(({p.fill_mib} * 1048576)) > /tmp/fill",
        f"dirty --mib {p.churn_mib} --pace-ms 100 > /dev/null &",
        "churn=$!",
        f"echo \"{EVENT} filled\"",
        "read go",
        "rm /tmp/fill",
        f"m0=$({marked})",
        f"echo 1000000 > {knobs.FLUSH}",
        f"m1=$({marked})",
        f"echo \"{EVENT} freed marked_reported=$((m1 - m0))\"",
        "read verify",
        "kill $churn; wait $churn || true",
        # exit 1 = non-zero bytes: the host reads the count from the JSON line
        f"populate --mib {p.verify_mib} --mode 4k --verify --tag dst-4k || [ $? -eq 1 ]",
        f"populate --mib {p.verify_mib} --mode thp --verify --tag dst-thp || [ $? -eq 1 ]",
    ]) + "\n"


def wait_migration(qmp: Qmp, done: object, timeout: float) -> dict:
    """Poll query-migrate until `done(info)` holds; fail on failed/cancelled."""
    deadline = time.monotonic() + timeout
    while True:
        info = qmp.execute("query-migrate")
        assert isinstance(info, dict)
        assert info.get("status") not in ("failed", "cancelled"), info
        if done(info):  # type: ignore[operator]
            return info
        assert time.monotonic() < deadline, f"migration stuck: {info}"
        time.sleep(0.2)


def kernel_warnings(g: Guest) -> list[str]:
    booted = next((i for i, ln in enumerate(g.lines) if ln.text.startswith(BOOTED)), 0)
    return [ln.text for ln in g.lines[booted:] if re.search(r"WARNING|BUG", ln.text)]


def test_reported_pages_read_zero_on_the_destination(tmp_path: Path) -> None:
    plan = Plan()
    shell = Shell()
    ctx = RunContext(shell=shell, run_dir=tmp_path, platform="qemu", accel="tcg", patched=True)
    if BASELINE == "stock":
        binary, init, cmdline = STOCK_QEMU, False, ["virtio_balloon.assume_reported_zero=1"]
    else:
        binary, init, cmdline = qemu.build(shell).binary, True, []
    runner = QemuRunner(shell, "tcg", binary)
    initrd = ctx.initrd("migrate-zero", guest_script(plan))
    port = free_port()
    common = dict(kernel=ctx.kernel(), initrd=initrd, mem_mib=plan.mem_mib,
                  device_init_reported=init, cmdline=cmdline)
    src_cfg = GuestConfig(**common, qmp_socket=tmp_path / "src.qmp")  # type: ignore[arg-type]
    dst_cfg = GuestConfig(**common, qmp_socket=tmp_path / "dst.qmp",  # type: ignore[arg-type]
                          incoming=f"tcp:127.0.0.1:{port}")
    src = runner.guest("src", src_cfg, ctx.log("src"), interactive=True)
    dst = runner.guest("dst", dst_cfg, ctx.log("dst"), interactive=True)
    t0 = time.monotonic()
    with src, dst:
        _, _, m = src.wait_for(rf"^{EVENT} features ([01]+)", 120)
        features = m.group(1)
        src.wait_for(rf"^{EVENT} filled", 300)
        qs, qd = Qmp(tmp_path / "src.qmp"), Qmp(tmp_path / "dst.qmp")
        try:
            qs.execute("migrate-set-parameters", **{
                "max-bandwidth": plan.bandwidth_mib_s * MIB, "downtime-limit": 1})
            qs.execute("migrate", uri=f"tcp:127.0.0.1:{port}")
            # the first pass has sent the data when the second sync begins
            first = wait_migration(qs, lambda i: i.get("ram", {}).get("dirty-sync-count", 0) >= 2,
                                   240)
            t_sent = time.monotonic() - t0
            src.send("go")
            _, _, m = src.wait_for(rf"^{EVENT} freed marked_reported=(\d+)", 120)
            marked = int(m.group(1))
            qs.execute("migrate-set-parameters", **{"downtime-limit": 2000})
            info = wait_migration(qs, lambda i: i.get("status") == "completed", 240)
            deadline = time.monotonic() + 30
            while (qd.execute("query-status") or {}).get("status") != "running":  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "destination did not resume"
                time.sleep(0.1)
        finally:
            qs.close()
            qd.close()
        dst.send("verify")
        rc = dst.wait_exit(300)
        records = {r["tag"]: r for r in dst.json_records("populate")}
        warnings = kernel_warnings(src) + kernel_warnings(dst)
    ram = info.get("ram", {})
    print(f"bit 6 negotiated: {features[BALLOON_BIT_DEVICE_INIT_REPORTED] == '1'}; "
          f"pages marked zero by reporting: {marked}; first pass sent after {t_sent:.0f} s "
          f"({first['ram']['transferred'] / MIB:.0f} MiB)")
    print(f"migration: {info.get('total-time')} ms, {ram.get('transferred', 0) / MIB:.0f} MiB, "
          f"{ram.get('duplicate')} zero pages, {ram.get('normal')} normal pages")
    for tag in ("dst-4k", "dst-thp"):
        if tag in records:
            print(f"{tag}: {records[tag]['nonzero_bytes']} non-zero bytes in "
                  f"{records[tag]['mib']} MiB")
    print(f"elapsed {time.monotonic() - t0:.0f} s")
    assert rc == 0, dst.tail(30)
    assert set(records) == {"dst-4k", "dst-thp"}, records
    # the debug kernel (CONFIG_DEBUG_PAGE_ZEROED) checks every page it hands
    # out as known zero: a stale one is a warning (and gets cleared)
    assert not warnings, warnings
    assert records["dst-4k"]["nonzero_bytes"] == 0, records["dst-4k"]
    assert records["dst-thp"]["nonzero_bytes"] == 0, records["dst-thp"]
    if BASELINE != "stock":  # the baseline guest trusts reports without the bit
        assert len(features) > BALLOON_BIT_DEVICE_INIT_REPORTED, features
        assert features[BALLOON_BIT_DEVICE_INIT_REPORTED] == "1", \
            f"bit 6 not negotiated ({features}): nothing is known zero, the test proves nothing"
    assert marked > 0, "reporting marked no page zero: the test would prove nothing"

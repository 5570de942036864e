"""Zero means zero across a live migration: discarded pages reach the destination as zeroes.

A guest on the patched QEMU with free page reporting and bit 6
(VIRTIO_BALLOON_F_DEVICE_INIT_REPORTED, proposed, not allocated) holds
~600 MiB of non-zero data in a tmpfs.  The host migrates it at 30 MiB/s to a
second QEMU; once the first pass has sent the data, the guest frees it and
forces a reporting pass, so the source discards pages the destination
already holds with the old contents.  After the switchover, verified
populates on the destination (4k and THP) must read zeroes only: the pages
the guest now believes zero must have been sent again as zeroes.

The destination starts paused (-S), so the host can compare its RAM with
the source's before it runs: the two must be identical, page for page (a
discarded page the destination did not get again differs).  Then the guest
runs and must find zeroes.  The guest's own checks keep the test from
passing vacuously: bit 6 must be negotiated and reporting must have marked
pages zero.

The same for the balloon (bit 7, VIRTIO_BALLOON_F_DEVICE_INIT_ON_INFLATE,
proposed, not allocated): the host inflates the balloon over the freed data
during the migration and deflates it on the destination; the deflated
pages, which the guest frees as zero, must read zero there.

The same for vhost-user-balloon (the Rust daemon behind the queue's
vhost-user-balloon-pci front-end, RAM in a shared memfd, one daemon per
side, both started with the experimental bit flags): the source's daemon
discards the reported pages and marks them in the vhost dirty log, and the
paused destination must hold what the source holds.  And a guest that
negotiated the bits cannot move to a daemon that does not offer them: the
destination refuses the stream, the guest keeps running on the source.

Baselines, expected to fail (FREEPAGE_MIGRATION_BASELINE=...):
* `stock`: Debian's QEMU (none of the qemu/ series), which discards reported pages
  without marking them dirty (reporting test; the guest does not get bit 6
  there, the host-side comparison fails all the same);
* `no-dirty`: the patched QEMU with qemu/bench/no-dirty-discards.patch,
  i.e. without "virtio-balloon: mark discarded memory dirty" (balloon test;
  the reporting test passes there: a used length > 0 marks the reported
  buffers dirty on its own);
* `unmigratable`: the patched QEMU with
  qemu/bench/vhost-user-balloon-unmigratable.patch, the vhost-user front-end
  as it was before it migrated (vhost-user test);
* `no-migrated-config`: the patched QEMU with
  qemu/bench/no-migrated-config.patch, whose vhost-user front-end does not
  hand the configuration to the destination's daemon (vhost-user test: the
  destination's daemon has target 0);
* `no-stats-rewind`: the patched QEMU with qemu/bench/no-stats-rewind.patch,
  whose vhost-user front-end leaves the stats buffer the source's daemon
  held consumed (vhost-user test: no statistics on the destination).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from freepage_lab import guestshell, harness, kernel, qemu
from freepage_lab.guest import Guest
from freepage_lab.guestram import differing_pages
from freepage_lab.initramfs import BOOTED, EVENT
from freepage_lab.runners import STOCK_QEMU, QemuRunner, Qmp
from freepage_lab.scenarios.migrate import MigrateParams, free_port, patched_capabilities
from freepage_lab.shell import Shell

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]

MIB = 1 << 20
BALLOON_BIT_DEVICE_INIT_REPORTED = 6
BALLOON_BIT_DEVICE_INIT_ON_INFLATE = 7
BASELINE = os.environ.get("FREEPAGE_MIGRATION_BASELINE", "")
DMESG = "FREEPAGE-DMESG"
# The debug kernel (CONFIG_DEBUG_PAGE_ZEROED) reads every page it hands out
# as known zero and warns once about a stale one (then clears it).  Its
# KUnit suite would use that one warning up at boot: no KUnit here.
CMDLINE = ["kunit.enable=0"]


# the guest, the data it frees mid-migration, the populates that verify
MEM_MIB, FILL_MIB, VERIFY_MIB = 1024, 600, 800
BANDWIDTH_MIB_S = 30
# keeps the migration from converging until the guest has freed its data
CHURN_MIB = 8
# vhost-user: a balloon the source's daemon asks for, which the destination's
# daemon must know after the migration (4 KiB pages)
VHOST_USER_TARGET_PAGES = 2048


vmstat = guestshell.zeroed_counter


def guest_script(report: bool = True) -> str:
    """Fill, wait for the host, free (+ report), wait for the host, verify."""
    balloon = ("for d in /sys/bus/virtio/devices/*; do "
               "[ \"$(cat $d/device)\" = 0x0005 ] && echo ${d##*/}; done | head -1")
    marked = vmstat("pgzero_marked_reported")
    features = guestshell.VIRTIO_FEATURES.format(dev="$dev")
    free = [
        # before the free: the series' own pass may report it before the flush
        f"m0=$({marked})",
        "rm /tmp/fill",
        guestshell.flush_cmd(),
        f"m1=$({marked})",
        f"echo \"{EVENT} freed marked_reported=$((m1 - m0))\"",
    ] if report else ["rm /tmp/fill", f"echo \"{EVENT} freed\""]
    return "\n".join([
        "echo 1000 > /proc/sys/vm/percpu_pagelist_high_fraction",
        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled",
        f"mount -o remount,size={FILL_MIB + 64}m /tmp",
        f"dev=$({balloon})",
        f"echo \"{EVENT} features $(cat {features})\"",
        # tr is slow under TCG: make 8 MiB with it, and the rest with cat
        "head -c 8388608 /dev/zero | tr '\\000' '\\245' > /tmp/chunk",
        f"cat $(yes /tmp/chunk | head -n {FILL_MIB // 8}) > /tmp/fill",
        "rm /tmp/chunk",
        f"dirty --mib {CHURN_MIB} --pace-ms 100 > /dev/null &",
        "churn=$!",
        f"echo \"{EVENT} filled\"",
        "read go",
        *free,
        "read verify",
        "kill $churn; wait $churn || true",
        f"echo \"{EVENT} verify marked_freed=$({vmstat('pgzero_marked_freed')})\"",
        # exit 1 = non-zero bytes: the host reads the count from the JSON line
        f"populate --mib {VERIFY_MIB} --mode 4k --verify --tag dst-4k || [ $? -eq 1 ]",
        f"populate --mib {VERIFY_MIB} --mode thp --verify --tag dst-thp || [ $? -eq 1 ]",
        f"echo \"{EVENT} vmstat $(grep -E '^pgzero_' {guestshell.ZEROED_STAT} | tr ' \\n' '= ')\"",
        # warnings print below the console's loglevel: show them from the log
        f"dmesg | grep -E 'WARNING:|BUG:|page_zeroed:' | sed 's/^/{DMESG} /' || true",
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
    """Kernel warnings: from the console, and the guest's own dmesg dump."""
    booted = next((i for i, ln in enumerate(g.lines) if ln.text.startswith(BOOTED)), 0)
    return [ln.text for ln in g.lines[booted:]
            if ln.text.startswith(DMESG) or re.search(r"WARNING:|BUG:", ln.text)]


def dump(qmp: Qmp, mib: int, path: Path) -> Path:
    qmp.execute("pmemsave", val=0, size=mib * MIB, filename=str(path))
    return path


def qemu_binary(shell: Shell) -> Path:
    if BASELINE == "stock":
        return STOCK_QEMU
    if BASELINE == "no-dirty":
        return qemu.build(shell, extra_patches=("no-dirty-discards.patch",)).binary
    if BASELINE == "unmigratable":
        return qemu.build(shell, extra_patches=("vhost-user-balloon-unmigratable.patch",)).binary
    if BASELINE == "no-migrated-config":
        return qemu.build(shell, extra_patches=("no-migrated-config.patch",)).binary
    if BASELINE == "no-stats-rewind":
        return qemu.build(shell, extra_patches=("no-stats-rewind.patch",)).binary
    return qemu.build(shell).binary


def balloon_actual_mib(qmp: Qmp) -> int:
    info = qmp.execute("query-balloon")
    assert isinstance(info, dict)
    return int(info["actual"]) // MIB


def wait_balloon(qmp: Qmp, target_mib: int, timeout: float) -> None:
    """Ask for a guest size and wait until the balloon driver got there."""
    qmp.execute("balloon", value=target_mib * MIB)
    deadline = time.monotonic() + timeout
    while balloon_actual_mib(qmp) != target_mib:
        assert time.monotonic() < deadline, \
            f"balloon at {balloon_actual_mib(qmp)} MiB, not {target_mib}, after {timeout:.0f} s"
        time.sleep(0.2)


@dataclass
class Outcome:
    features: str
    events: dict[str, dict[str, int]]
    populates: dict[str, dict]
    warnings: list[str]
    rc: int
    migration: dict
    console_tail: str
    differing_pages: int
    # vhost-user: the destination's daemon after the migration (get_counters)
    dst_daemon: dict | None = None

    def bit(self, n: int) -> bool:
        return len(self.features) > n and self.features[n] == "1"


def migrate_while_freeing(lab, report: bool, inflate_mib: int = 0, vhost_user: bool = False,
                          **device: bool) -> Outcome:
    """Boot, fill, migrate; free (and inflate) mid-migration; verify on the destination.
    `device`: the balloon's bits (GuestConfig fields), as the test asks;
    `vhost_user`: vhost-user-balloon-pci and a daemon per side offering both bits."""
    tmp_path = lab.tmp_path
    ctx = lab.context("qemu", patched=True)
    runner = QemuRunner(ctx.shell, "tcg", qemu_binary(ctx.shell))
    port = free_port()
    # a device offering bits 6/7 gets a guest that opts in to them
    variant = harness.Variant("migrate", reporting=report, vhost_user=vhost_user,
                              zeroing=vhost_user or any(device.values()))
    boot = dict(initrd="migrate-zero", mem_mib=MEM_MIB, cmdline=tuple(CMDLINE),
                interactive=True, run_with=runner)
    script = guest_script(report)
    t0 = time.monotonic()
    events: dict[str, dict[str, int]] = {}

    def event(g: Guest, name: str, timeout: float) -> None:
        _, line, _ = g.wait_for(rf"^{EVENT} {name}\b", timeout)
        events[name] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line.text)}
        print(f"[{time.monotonic() - t0:5.0f} s] {line.text}", flush=True)

    # -S: the destination stays paused after the migration, for the compare
    with lab.start(ctx, "src", script, variant, **boot,
                   overrides=dict(device, qmp_socket=tmp_path / "src.qmp")) as src_run, \
            lab.start(ctx, "dst", script, variant, **boot,
                      extra_args=("-S",),
                      overrides=dict(device, qmp_socket=tmp_path / "dst.qmp",
                                     incoming=f"tcp:127.0.0.1:{port}")) as dst_run:
        src, dst = src_run.guest, dst_run.guest
        _, _, m = src.wait_for(rf"^{EVENT} features ([01]+)", 120)
        features = m.group(1)
        event(src, "filled", 300)
        if vhost_user:
            set_daemon_target(src_run.backend, VHOST_USER_TARGET_PAGES, 120)
        qs, qd = Qmp(tmp_path / "src.qmp"), Qmp(tmp_path / "dst.qmp")
        try:
            if BASELINE != "stock":
                # the patched QEMU skips RAM that reads as zero, as the migrate
                # scenario has it (both ends); the switchover is stock's
                p = MigrateParams(switchover_after_first_pass=False)
                for q, source in ((qs, True), (qd, False)):
                    q.execute("migrate-set-capabilities",
                              capabilities=patched_capabilities(p, source))
            qs.execute("migrate-set-parameters", **{
                "max-bandwidth": BANDWIDTH_MIB_S * MIB, "downtime-limit": 1})
            qs.execute("migrate", uri=f"tcp:127.0.0.1:{port}")
            # the first pass has sent the data when the second sync begins
            first = wait_migration(qs, lambda i: i.get("ram", {}).get("dirty-sync-count", 0) >= 2,
                                   240)
            print(f"[{time.monotonic() - t0:5.0f} s] first pass sent "
                  f"{first['ram']['transferred'] / MIB:.0f} MiB", flush=True)
            src.send("go")
            event(src, "freed", 120)
            if inflate_mib:
                wait_balloon(qs, MEM_MIB - inflate_mib, 180)
                print(f"[{time.monotonic() - t0:5.0f} s] inflated {inflate_mib} MiB", flush=True)
            qs.execute("migrate-set-parameters", **{"downtime-limit": 2000})
            info = wait_migration(qs, lambda i: i.get("status") == "completed", 240)
            wait_migration(qd, lambda i: i.get("status") == "completed", 60)
            # both stopped: the destination must hold what the source holds
            differ, where = differing_pages(dump(qs, MEM_MIB, tmp_path / "src.mem"),
                                            dump(qd, MEM_MIB, tmp_path / "dst.mem"))
            for name in ("src.mem", "dst.mem"):
                (tmp_path / name).unlink()
            print(f"[{time.monotonic() - t0:5.0f} s] {differ} pages differ between source and "
                  f"destination (first at {', '.join(hex(g) for g in where) or '-'})", flush=True)
            qd.execute("cont")
            deadline = time.monotonic() + 30
            while (qd.execute("query-status") or {}).get("status") != "running":  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "destination did not resume"
                time.sleep(0.1)
            ram = info.get("ram", {})
            print(f"[{time.monotonic() - t0:5.0f} s] migrated: {info.get('total-time')} ms, "
                  f"{ram.get('transferred', 0) / MIB:.0f} MiB, {ram.get('duplicate')} zero "
                  f"pages, {ram.get('normal')} normal pages", flush=True)
            if inflate_mib:
                wait_balloon(qd, MEM_MIB, 180)
                print(f"[{time.monotonic() - t0:5.0f} s] deflated on the destination", flush=True)
            dst_daemon = None
            if vhost_user:
                # the stats buffer the source's daemon held is the destination's now
                stats = dst_run.backend.request({"cmd": "get_stats", "wait_ms": 4000})
                dst_daemon = dst_run.backend.request({"cmd": "get_counters"})
                dst_daemon["stats"] = stats
        finally:
            qs.close()
            qd.close()
        dst.send("verify")
        event(dst, "verify", 60)
        event(dst, "vmstat", 300)
        rc = dst.wait_exit(60)
        populates = {r["tag"]: r for r in dst.json_records("populate")}
        warnings = kernel_warnings(src) + kernel_warnings(dst)
    for tag, r in populates.items():
        print(f"{tag}: {r['nonzero_bytes']} non-zero bytes in {r['mib']} MiB")
    print(f"bits negotiated: 6={features[6:7]} 7={features[7:8]}; warnings: {warnings[:3]}; "
          f"elapsed {time.monotonic() - t0:.0f} s")
    return Outcome(features, events, populates, warnings, rc, info, dst.tail(30), differ,
                   dst_daemon)


def set_daemon_target(backend, pages: int, timeout: float) -> None:
    """Ask the guest for a balloon through the daemon, wait until it got there."""
    backend.request({"cmd": "set_target", "pages": pages})
    deadline = time.monotonic() + timeout
    while (c := backend.request({"cmd": "get_counters"}))["actual"] != pages:
        assert time.monotonic() < deadline, f"balloon at {c['actual']} pages, not {pages}"
        time.sleep(0.2)


def assert_destination_reads_zero(out: Outcome) -> None:
    assert out.differing_pages == 0, \
        f"the destination's RAM differs from the source's in {out.differing_pages} pages"
    assert out.rc == 0, out.console_tail
    assert set(out.populates) == {"dst-4k", "dst-thp"}, out.populates
    # a stale page the debug kernel caught (and cleared) is counted, and a
    # warning where the kernel has CONFIG_BUG
    assert out.events["vmstat"].get("pgzero_verify_failed", 0) == 0, out.events["vmstat"]
    assert not out.warnings, out.warnings
    for tag in ("dst-4k", "dst-thp"):
        assert out.populates[tag]["nonzero_bytes"] == 0, out.populates[tag]


def test_reported_pages_read_zero_on_the_destination(lab) -> None:
    out = migrate_while_freeing(lab, report=True,
                                device_init_reported=BASELINE != "stock")
    assert_destination_reads_zero(out)
    if BASELINE != "stock":  # stock QEMU does not offer the bit
        assert out.bit(BALLOON_BIT_DEVICE_INIT_REPORTED), \
            f"bit 6 not negotiated ({out.features}): nothing is known zero, the test proves nothing"
    if BASELINE != "stock":
        assert out.events["freed"]["marked_reported"] > 0, \
            "reporting marked no page zero: the test would prove nothing"


@pytest.mark.skipif(BASELINE == "stock", reason="stock QEMU has no vhost-user-balloon-pci")
def test_vhost_user_reported_pages_read_zero_on_the_destination(lab) -> None:
    out = migrate_while_freeing(lab, report=True, vhost_user=True)
    assert out.bit(BALLOON_BIT_DEVICE_INIT_REPORTED) and \
        out.bit(BALLOON_BIT_DEVICE_INIT_ON_INFLATE), \
        f"bits 6/7 not negotiated ({out.features}): nothing is known zero, the test proves nothing"
    assert out.events["freed"]["marked_reported"] > 0, \
        "reporting marked no page zero: the test would prove nothing"
    assert_destination_reads_zero(out)
    # the balloon moved with the guest: the destination's daemon got the
    # source's target and the guest's actual (SET_CONFIG of a migration)
    assert out.dst_daemon is not None
    print(f"destination daemon: target {out.dst_daemon['target']}, "
          f"actual {out.dst_daemon['actual']}")
    assert out.dst_daemon["target"] == VHOST_USER_TARGET_PAGES, out.dst_daemon
    assert out.dst_daemon["actual"] == VHOST_USER_TARGET_PAGES, out.dst_daemon
    print(f"destination daemon: stats {out.dst_daemon['stats']}")
    assert out.dst_daemon["stats"].get("stats"), out.dst_daemon["stats"]


@pytest.mark.skipif(BASELINE == "stock", reason="stock QEMU has no vhost-user-balloon-pci")
def test_vhost_user_bits_do_not_migrate_to_a_daemon_without_them(lab) -> None:
    """Both daemons must be started with the same x- flags: a guest that
    negotiated bits 6/7 cannot go to a destination whose daemon does not
    offer them.  The destination refuses the stream (QEMU's virtio_load());
    with the return path the source learns it, fails the migration and
    runs the guest on (without it the source would call the migration
    completed and leave the guest paused)."""
    tmp_path = lab.tmp_path
    ctx = lab.context("qemu", patched=True)
    runner = QemuRunner(ctx.shell, "tcg", qemu_binary(ctx.shell))
    port = free_port()
    features = guestshell.VIRTIO_FEATURES.format(dev="$dev")
    script = "\n".join([
        "dev=$(for d in /sys/bus/virtio/devices/*; do "
        "[ \"$(cat $d/device)\" = 0x0005 ] && echo ${d##*/}; done | head -1)",
        f"echo \"{EVENT} features $(cat {features})\"",
        "read go",
        f"echo \"{EVENT} alive\"",
    ]) + "\n"
    boot = dict(initrd="migrate-bits", mem_mib=256, cmdline=tuple(CMDLINE),
                interactive=True, run_with=runner)
    on = harness.Variant("bits-on", vhost_user=True, zeroing=True)
    off = harness.Variant("bits-off", vhost_user=True, zeroing=False)
    with lab.start(ctx, "src", script, on, **boot,
                   overrides=dict(qmp_socket=tmp_path / "src.qmp")) as src_run, \
            lab.start(ctx, "dst", script, off, **boot,
                      overrides=dict(qmp_socket=tmp_path / "dst.qmp",
                                     incoming=f"tcp:127.0.0.1:{port}")) as dst_run:
        src, dst = src_run.guest, dst_run.guest
        _, _, m = src.wait_for(rf"^{EVENT} features ([01]+)", 120)
        negotiated = m.group(1)
        assert negotiated[6:8] == "11", f"bits 6/7 not negotiated on the source: {negotiated}"
        qs, qd = Qmp(tmp_path / "src.qmp"), Qmp(tmp_path / "dst.qmp")
        try:
            for q in (qs, qd):
                q.execute("migrate-set-capabilities",
                          capabilities=[{"capability": "return-path", "state": True}])
            qs.execute("migrate", uri=f"tcp:127.0.0.1:{port}")
            deadline = time.monotonic() + 240
            while True:
                info = qs.execute("query-migrate")
                assert isinstance(info, dict)
                status = info.get("status")
                if status in ("failed", "completed", "cancelled"):
                    break
                assert time.monotonic() < deadline, f"migration stuck: {info}"
                time.sleep(0.2)
            running = (qs.execute("query-status") or {}).get("status")  # type: ignore[union-attr]
        finally:
            qs.close()
            qd.close()
        _, line, _ = dst.wait_for(r"Features 0x[0-9a-f]+ unsupported", 30)
        print(f"source: migration {status}, guest {running}; destination: {line.text}")
        assert status == "failed", info
        assert running == "running"
        src.send("go")
        src.wait_for(rf"^{EVENT} alive", 60)
        dst_log = "\n".join(ln.text for ln in dst.lines)
    assert "Failed to load virtio" in dst_log or "load of migration failed" in dst_log, dst_log[-2000:]


@pytest.mark.skipif(BASELINE == "stock", reason="stock QEMU does not offer bit 7")
def test_deflated_pages_read_zero_on_the_destination(lab) -> None:
    out = migrate_while_freeing(lab, report=False, inflate_mib=FILL_MIB - 100,
                                device_init_on_inflate=True)
    assert_destination_reads_zero(out)
    assert out.bit(BALLOON_BIT_DEVICE_INIT_ON_INFLATE), \
        f"bit 7 not negotiated ({out.features}): nothing is known zero, the test proves nothing"
    assert out.events["verify"]["marked_freed"] > 0, \
        "no deflated page was freed as zero: the test would prove nothing"

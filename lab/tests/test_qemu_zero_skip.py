"""RAM the source does not send must read zero on the destination, whatever backs it there.

The patched source does not send RAM that reads zero on its side (never
written, or discarded).  That is only right where the destination's RAM
reads zero too, which the source cannot see: migration matches RAM blocks by
name and size, not by what backs them.  Here the source's RAM is private
anonymous memory it never wrote (the guest is never started, -S), and the
destination's is a memory-backend-file (share=on) in /dev/shm that holds
0xaa in every byte before the migration, as a file kept from an earlier
run would.

The migration goes as the migrate scenario migrates (its capabilities on
both ends, which on the patched QEMU include the zero-skip capability, or
with `skip_unpopulated=false` do not).  Then either the migration
completed and the destination's RAM, read back through its file, equals
the source's page for page; or it failed and the destination said why
(the block it cannot discard to zero).  A completed migration that leaves
the pattern in the destination's RAM fails the test.

Baseline, expected to fail (FREEPAGE_ZERO_SKIP_BASELINE=no-discard): the
patched QEMU with qemu/bench/skip-unpopulated-no-discard.patch, whose
destination neither discards its RAM nor refuses the file (skip on: the
pattern stays in every page the source skipped).
"""

from __future__ import annotations

import mmap
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from freepage_lab import harness, kernel
from freepage_lab.runners import Qmp
from freepage_lab.scenarios.migrate import (
    Migrate,
    MigrateParams,
    destination_outcome,
    free_port,
)
from freepage_lab.shell import LabError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]

MIB = 1 << 20
MEM_MIB = 256
PATTERN = 0xAA
# the RAM block (and backend) of both ends: QEMU's default name for a pc's RAM
BLOCK = "pc.ram"
PAGE = 4096
BASELINE = os.environ.get("FREEPAGE_ZERO_SKIP_BASELINE", "")
BASELINE_PATCHES = {"no-discard": "skip-unpopulated-no-discard.patch"}
# guest-physical addresses that do not map pc.ram on a pc machine (VGA
# window, option ROMs, the BIOS's alias): pmemsave reads something else there
LEGACY_HOLE = (0xA0000, 0x100000)
# what the destination says when it refuses a block it cannot discard to zero
REFUSAL = re.compile(r"cannot (?:be )?discard.*|.*does not read as zero.*", re.I)


def prefilled_file(size: int) -> Path:
    path = Path("/dev/shm") / f"freepage-zero-skip-{uuid.uuid4().hex[:8]}.mem"
    chunk = bytes([PATTERN]) * MIB
    with open(path, "wb") as fh:
        for _ in range(size // MIB):
            fh.write(chunk)
    return path


def differing_pages(src: Path, dst: Path) -> tuple[int, list[int]]:
    """4 KiB pages that differ between the source's pmemsave and the
    destination's RAM file, outside the legacy hole (count, first offsets)."""
    count, first = 0, []
    with open(src, "rb") as fa, open(dst, "rb") as fb:
        a = mmap.mmap(fa.fileno(), 0, access=mmap.ACCESS_READ)
        b = mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ)
        assert len(a) == len(b), (len(a), len(b))
        for off in range(0, len(a), PAGE):
            if LEGACY_HOLE[0] <= off < LEGACY_HOLE[1]:
                continue
            if a[off:off + PAGE] != b[off:off + PAGE]:
                count += 1
                if len(first) < 4:
                    first.append(off)
        a.close()
        b.close()
    return count, first


@pytest.mark.parametrize("skip_unpopulated", [True, False], ids=["skip-on", "skip-off"])
def test_a_prefilled_destination_ends_equal_to_the_source_or_refuses(lab,
                                                                     skip_unpopulated) -> None:
    ctx = lab.context("qemu", patched=True,
                      qemu_extra_patches=(BASELINE_PATCHES[BASELINE],) if BASELINE else ())
    variant = harness.family("migrate")["no-hint"]
    p = MigrateParams(mem_mib=MEM_MIB, timeout_s=120, skip_unpopulated=skip_unpopulated)
    port = free_port()
    ram = prefilled_file(MEM_MIB * MIB)
    # -S on both ends: the source's guest never writes its RAM, and the
    # destination stays stopped after the migration for the compare
    # the same block name on both ends (migration matches blocks by name)
    boot = dict(initrd="zero-skip", mem_mib=MEM_MIB,
                extra_args=("-S", "-object", f"memory-backend-ram,id={BLOCK},size={MEM_MIB}M",
                            "-machine", f"memory-backend={BLOCK}"))
    dst_args = ("-S", "-object",
                f"memory-backend-file,id={BLOCK},size={MEM_MIB}M,mem-path={ram},share=on",
                "-machine", f"memory-backend={BLOCK}")
    src_qmp, dst_qmp = lab.tmp_path / "src.qmp", lab.tmp_path / "dst.qmp"
    outcome, error = "", ""
    try:
        with lab.start(ctx, "src", "", variant, **boot,
                       overrides=dict(qmp_socket=src_qmp)), \
                lab.start(ctx, "dst", "", variant, **{**boot, "extra_args": dst_args},
                          overrides=dict(qmp_socket=dst_qmp, incoming="defer")) as dst:
            qs, qd = Qmp(src_qmp), Qmp(dst_qmp)
            try:
                try:
                    Migrate().migrate(p, "zero-skip", "precopy", qs, qd, port,
                                      patched_qemu=True)
                    outcome = "completed"
                except LabError as exc:
                    outcome, error = "failed", str(exc)
                # the source completes without a return path even where the
                # destination refused the stream: ask the destination
                info = destination_outcome(qd, dst.guest, 30) or {}
                if dst.guest.alive() and info.get("status") == "completed":
                    qs.execute("pmemsave", val=0, size=MEM_MIB * MIB,
                               filename=str(lab.tmp_path / "src.mem"))
                else:
                    outcome = "failed"
            finally:
                qs.close()
                qd.close()
            time.sleep(0.5)
            dst_log = "\n".join(ln.text for ln in dst.guest.lines)
        if outcome == "failed":
            refusal = REFUSAL.search(dst_log)
            print(f"migration failed: {error or '-'}; destination: "
                  f"{refusal.group(0) if refusal else dst_log[-500:]}")
            assert skip_unpopulated, f"nothing to refuse with the skip off: {dst_log[-2000:]}"
            assert refusal, f"the destination failed without saying why: {dst_log[-2000:]}"
            assert BLOCK in refusal.group(0), refusal.group(0)
            return
        differ, where = differing_pages(lab.tmp_path / "src.mem", ram)
        with open(ram, "rb") as fh:
            pattern_left = sum(chunk.count(PATTERN) for chunk in iter(lambda: fh.read(MIB), b""))
        print(f"migration completed: {differ} pages differ between the source and the "
              f"destination's RAM file (first at {', '.join(hex(o) for o in where) or '-'}); "
              f"{pattern_left} bytes of the file read {PATTERN:#x}")
        assert differ == 0, \
            (f"the destination's RAM keeps what it held before the migration in {differ} "
             f"pages: the source did not send them and the destination did not clear them")
    finally:
        os.unlink(ram)
        (lab.tmp_path / "src.mem").unlink(missing_ok=True)

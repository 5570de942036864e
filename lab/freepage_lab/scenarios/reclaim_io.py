"""reclaim-io: reclaim's populate/free rounds in a Debian guest doing file I/O.

A Debian guest (platform qemu-debian: Debian's user space on a virtio-blk
root) keeps reading and writing files while it populates X MiB and frees
it, round after round, and the host measures how much of each free is
off its footprint within 1 s and 2 s, as reclaim does. The I/O, `io_mib_s`
in all, in chunks of `io_chunk_mib`, each worker paced to its share:

  reader        half: chunks of a file on the root disk through the page
                cache (`dd iflag=nocache`: read from the disk, then dropped)
  disk writer   a quarter: a file on the root disk written, fdatasync'd
                and removed (dirty page cache, writeback, then freed)
  tmpfs writer  a quarter: a file in /tmp written and removed

The allocator traffic this makes (pgalloc and pgfree) is what the
series' hold of a reporting pass looks at: the guest prints the I/O each
worker did, the seconds, and the pages allocated and freed meanwhile; the
series' counters (held_passes among them) are sampled every `trace_ms`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .. import harness
from ..context import RunContext
from . import Outcome, table
from .reclaim import Boot, ReclaimParams, ReclaimScenario, guest_script

IO_PROG = "io"
# where the workload's files go: the root disk, and the init's tmpfs
IO_DISK_DIR = "/var/tmp/freepage-io"
IO_TMPFS_DIR = "/tmp/freepage-io"
# the file the reader goes through, MiB
READ_FILE_MIB = 64
MIB = 1 << 20
PAGE = 4096


@dataclass
class ReclaimIoParams(ReclaimParams):
    modes: tuple[str, ...] = ("4k",)
    variants: tuple[str, ...] = ("freepage",)
    # one free per boot, as reclaim's published rows: frees a few seconds
    # apart look like a loop to the series' back-off, which then waits
    repeat: int = 5
    rounds: int = 1
    mem_mib: int = 1024
    populate_mib: int = 256
    # long enough for a pass held the longest (60 s) to run
    settle_s: int = 65
    # the I/O in all, MiB per second (half read, a quarter each written);
    # 0: the same guest and rounds without it
    io_mib_s: int = 32
    io_chunk_mib: int = 4
    trace_ms: int = 500


def pace(rate_mib_s: float, chunk_mib: int) -> str:
    """Seconds between chunks for `rate_mib_s` (three decimals, for sleep)."""
    return f"{chunk_mib / rate_mib_s:.3f}"


def io_functions(p: ReclaimIoParams, disk_dir: str = IO_DISK_DIR,
                 tmpfs_dir: str = IO_TMPFS_DIR) -> str:
    """Guest shell: `io_start` starts the three workers in the background,
    `io_stop` stops them and prints one JSON line with what they did
    (their files in `disk_dir` and `tmpfs_dir`)."""
    c = p.io_chunk_mib
    dd = "dd bs=1M status=none"
    workers = {
        # chunk n of the read file, through the page cache and dropped again
        "read": (p.io_mib_s / 2,
                 f"{dd} if={disk_dir}/read of=/dev/null count={c} "
                 f"skip=$(( (n * {c}) % {READ_FILE_MIB} )) iflag=nocache"),
        "disk_write": (p.io_mib_s / 4,
                       f"{dd} if=/dev/zero of={disk_dir}/write count={c} conv=fdatasync"
                       f" && rm {disk_dir}/write"),
        "tmpfs_write": (p.io_mib_s / 4,
                        f"{dd} if=/dev/zero of={tmpfs_dir}/write count={c}"
                        f" && rm {tmpfs_dir}/write"),
    }
    lines = [
        # %.0f: awk prints a sum past 2^31 as 2.28244e+09, which $(( )) refuses
        "traffic() { awk '$1 ~ /^pgalloc_/ || $1 == \"pgfree\" {s += $2} END {printf \"%.0f\\n\", s}' "
        "/proc/vmstat; }",
        "now() { cut -d' ' -f1 /proc/uptime; }",
        # worker NAME PERIOD CMD: CMD every PERIOD s from its start (on a
        # schedule, so a slow chunk is made up), its count in a file at the end
        "worker() {",
        "\tn=0; t0=$(now)",
        f"\twhile [ ! -e {tmpfs_dir}/stop ]; do",
        "\t\teval \"$3\"",
        "\t\tn=$((n + 1))",
        "\t\tsleep $(awk -v t0=\"$t0\" -v n=$n -v p=\"$2\" "
        "'{d = t0 + n * p - $1; print (d > 0 ? d : 0)}' /proc/uptime)",
        "\tdone",
        f"\techo $((n * {c})) > {tmpfs_dir}/$1",
        "}",
        "io_start() {",
        f"\tmkdir -p {disk_dir} {tmpfs_dir}; rm -f {tmpfs_dir}/stop",
        f"\t{dd} if=/dev/zero of={disk_dir}/read count={READ_FILE_MIB} conv=fsync",
        f"\tdd if={disk_dir}/read iflag=nocache count=0 status=none",
        "\tio_t0=$(now); io_p0=$(traffic)",
    ]
    for name, (rate, cmd) in workers.items():
        if rate <= 0:  # io_mib_s=0: the same guest without the I/O
            lines.append(f"\techo 0 > {tmpfs_dir}/{name}")
            continue
        quoted = cmd.replace('"', '\\"').replace("$", "\\$")
        lines.append(f"\tworker {name} {pace(rate, c)} \"{quoted}\" &")
    lines += [
        "}",
        "io_stop() {",
        f"\ttouch {tmpfs_dir}/stop; wait",
        "\tio_t1=$(now); io_p1=$(traffic)",
        f"\tprintf '{{\"prog\":\"{IO_PROG}\",\"seconds\":%s,\"alloc_free_pages\":%s"
        + "".join(f',"{name}_mib":%s' for name in workers) + "}\\n' "
        "$(awk -v a=\"$io_t0\" -v b=\"$io_t1\" 'BEGIN {print b - a}') $((io_p1 - io_p0)) "
        + " ".join(f"$(cat {tmpfs_dir}/{name})" for name in workers),
        "}",
    ]
    return "\n".join(lines)


def io_script(p: ReclaimIoParams) -> str:
    """reclaim's guest script with the I/O running from before the first
    populate to after the last settle; the series' counters every trace_ms."""
    body = guest_script(p)
    return "\n".join([io_functions(p), "io_start", body.rstrip("\n"), "io_stop"]) + "\n"


def io_rates(workload: list[dict[str, Any]]) -> dict[str, float]:
    """MiB/s of each worker and of allocator traffic (pgalloc + pgfree) in one boot."""
    if not workload:
        return {}
    w = workload[-1]
    secs = float(w["seconds"]) or float("nan")
    out = {k.removesuffix("_mib"): float(v) / secs for k, v in w.items() if k.endswith("_mib")}
    out["io"] = sum(out.values())
    out["alloc_free"] = float(w["alloc_free_pages"]) * PAGE / MIB / secs
    return out


def held_passes(trace: list[dict[str, Any]]) -> tuple[int, int]:
    """Passes held back and passes run over a boot's trace (last less first sample)."""
    rows = [r for r in trace if r.get("held_passes") not in (None, "null")]
    if len(rows) < 2:
        return 0, 0
    return (int(rows[-1]["held_passes"]) - int(rows[0]["held_passes"]),
            int(rows[-1]["passes"]) - int(rows[0]["passes"]))


class ReclaimIo(ReclaimScenario):
    name = "reclaim-io"
    Params = ReclaimIoParams
    platforms = ("qemu-debian",)
    needs = "a Debian root on a disk, whose page cache the I/O goes through"

    def script(self, params: Any) -> str:
        return io_script(params)

    def _boot(self, params: ReclaimParams, booted: harness.Booted, rep: int) -> Boot:
        boot = super()._boot(params, booted, rep)
        boot.workload = booted.records(IO_PROG)
        return boot

    def _report(self, ctx: RunContext, params: ReclaimParams, boots: list[Boot]) -> Outcome:
        out = super()._report(ctx, params, boots)
        rows, per_variant = [], {}
        for v in params.variants:
            mine = [b for b in boots if b.variant == v]
            rates = [io_rates(b.workload) for b in mine]
            held = [held_passes(b.trace) for b in mine]
            per_variant[v] = {"io_mib_s": rates, "held_passes": [h for h, _ in held],
                              "passes": [n for _, n in held]}
            med = {k: statistics.median(r[k] for r in rates if k in r)
                   for k in ("read", "disk_write", "tmpfs_write", "io", "alloc_free")
                   if any(k in r for r in rates)}
            rows.append([v, *(f"{med[k]:.1f}" if k in med else "n/a"
                              for k in ("read", "disk_write", "tmpfs_write", "io", "alloc_free")),
                         "/".join(str(h) for h, _ in held), "/".join(str(n) for _, n in held)])
        out.data["io"] = per_variant
        out.table += ("\n\nI/O while the rounds ran (MiB/s, median over boots; held passes "
                      "and passes per boot)\n"
                      + table(["variant", "read", "disk write", "tmpfs write", "I/O",
                               "pgalloc+pgfree", "held passes", "passes"], rows))
        ctx.save(f"{self.name}-{ctx.platform}", out.data)
        return out

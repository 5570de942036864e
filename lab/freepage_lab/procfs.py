"""The host's /proc, read for the lab: process groups, memory, faults and CPU time."""

from __future__ import annotations

import os
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _field_kib(path: str, key: str) -> int | None:
    """The value of `key:` in a /proc file of "key: N kB" lines, in bytes;
    None once the process has exited (or a zombie, which has none)."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident set of one process (VmRSS); None once it has exited."""
    return _field_kib(f"/proc/{pid}/status", "VmRSS:")


def host_commit_limit_mib() -> int:
    """The largest mapping Linux's heuristic overcommit (vm.overcommit_memory
    0, the default) lets a process reserve: the host's RAM plus swap, MiB."""
    total = sum(_field_kib("/proc/meminfo", key) or 0 for key in ("MemTotal:", "SwapTotal:"))
    return total >> 20


def host_available_mib() -> int:
    """The host's MemAvailable, MiB."""
    return (_field_kib("/proc/meminfo", "MemAvailable:") or 0) >> 20


def anon_huge_bytes(pid: int) -> int | None:
    """AnonHugePages of one process (smaps_rollup); None once it has exited."""
    return _field_kib(f"/proc/{pid}/smaps_rollup", "AnonHugePages:")


def deleted_file(pid: int) -> str | None:
    """The largest deleted regular file a process holds open, as a /proc fd
    path: UML's physical memory, or the memfd of QEMU's shared guest RAM."""
    best, best_size = None, -1
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in fds:
        path = f"{fd_dir}/{fd}"
        try:
            target = os.readlink(path)
            st = os.stat(path)
        except OSError:
            continue
        if target.endswith("(deleted)") and st.st_size > best_size:
            best, best_size = path, st.st_size
    return best


def allocated_bytes(path: str | None) -> int | None:
    """Blocks a (sparse) file really holds, in bytes; None if it is gone."""
    if path is None:
        return None
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return None


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; the name may hold anything."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group."""
    live = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(entry))
    return live


@dataclass
class Usage:
    """Faults and CPU seconds of a set of host processes (children they reaped included)."""

    minflt: int = 0
    majflt: int = 0
    cpu_s: float = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.minflt + other.minflt, self.majflt + other.majflt,
                     self.cpu_s + other.cpu_s)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.minflt - other.minflt, self.majflt - other.majflt,
                     self.cpu_s - other.cpu_s)

    @property
    def faults(self) -> int:
        return self.minflt + self.majflt


def parse_proc_stat(text: str, clk_tck: int = CLK_TCK) -> Usage:
    """/proc/<pid>/stat -> own + reaped children's faults and CPU time.

    UML runs each guest address space in a host process that its kernel
    process reaps: counting children keeps an exited process's faults.
    """
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): minflt is field 10, utime 14 (proc(5))
    minflt, cminflt, majflt, cmajflt = (int(fields[i]) for i in (7, 8, 9, 10))
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    return Usage(minflt + cminflt, majflt + cmajflt,
                 (utime + stime + cutime + cstime) / clk_tck)


def process_usage(pid: int) -> Usage:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return parse_proc_stat(fh.read())
    except (OSError, IndexError, ValueError):
        return Usage()


def group_usage(pgid: int) -> Usage:
    """Every live process of a guest's process group (QEMU, or UML and its helpers)."""
    total = Usage()
    for pid in group_members(pgid):
        total = total + process_usage(pid)
    return total

"""Guest shell: the paths of the kernel's interfaces and the snippets that
every guest script shares, in one place.

Scripts are busybox sh, run by the guest's init with `sh -e`; the lines
here are safe there (a probe that may fail ends in `|| true`).
"""

from __future__ import annotations

from .initramfs import EVENT

# -- free page reporting (the series' tunables in sysfs, the rest in debugfs) ----

# the tunables: delay_ms, budget_pages, batch (the order is the module parameter)
REPORTING_SYSFS = "/sys/kernel/mm/page_reporting"
REPORTING_TUNABLES = ("delay_ms", "budget_pages", "batch")
# counters and the flush trigger (the guest's init mounts debugfs)
REPORTING_DIR = "/sys/kernel/debug/page_reporting"
# Write a page budget: one reporting pass runs now, the write returns when
# it is done: ENODEV without a reporting device, ENODATA if nothing was
# reported, the device's error if it failed (freepage series only).
FLUSH = f"{REPORTING_DIR}/flush"
# the series' counters, in the order every script prints them
REPORTING_COUNTERS = ("passes", "time_us", "reported_pages", "reused_pages", "pcp_drained_pages",
                      "held_passes")
# a line per counter at the end of a boot (reported_pages: one number per order)
COUNTER_TAG = "REPORTING-COUNTER"

# -- zeroed free page tracking ---------------------------------------------------

# the series' counters (pgzero_*), "name value" lines as in /proc/vmstat, in
# debugfs while the design settles
ZEROED_STAT = "/sys/kernel/debug/page_zeroed/stat"
# pre-zeroing's counters of one node (pgzero_prezero_cleared, _remote)
ZEROED_NODE_STAT = "/sys/kernel/debug/page_zeroed/node{nid}"
# /proc/vmstat followed by the series' counters, as one stream to pipe into
# grep or awk (only /proc/vmstat on a stock kernel)
VMSTAT_ALL = f"{{ cat /proc/vmstat; cat {ZEROED_STAT} 2>/dev/null || true; }}"


def zeroed_counter(name: str) -> str:
    """A command that prints the value of the series' counter `name`."""
    return f"awk '/^{name} /{{print $2}}' {ZEROED_STAT}"

# -- the balloon ------------------------------------------------------------------

# VIRTIO_BALLOON_F_DEVICE_INIT_REPORTED: proposed to the virtio TC
# (virtio-spec issue #244), not allocated yet
BIT_DEVICE_INIT_REPORTED = 6
BIT_DEVICE_INIT_ON_INFLATE = 7
# virtio feature bits the guest negotiated, one '0'/'1' per bit
VIRTIO_FEATURES = "/sys/bus/virtio/devices/{dev}/features"
# the balloon's negotiated feature string, from a guest shell
BALLOON_FEATURES = "$(cat /sys/bus/virtio/drivers/virtio_balloon/virtio*/features)"
# the script ends (exit 4) unless a virtio_balloon device is bound
BALLOON_BOUND = ("ls -d /sys/bus/virtio/drivers/virtio_balloon/virtio* >/dev/null 2>&1 || "
                 "{ echo 'no virtio_balloon device bound' >&2; exit 4; }")

# -- memory management knobs ----------------------------------------------------

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
PCP_HIGH_FRACTION = "/proc/sys/vm/percpu_pagelist_high_fraction"
PREZERO_DIR = "/sys/kernel/mm/prezero"
# the pre-zeroing counters prezero_helpers() prints with every event
PREZERO_COUNTERS = ("pgzero_marked_prezero", "pgzero_prezero_aborted", "pgzero_prezero_hugetlb",
                    "pgzero_skipped", "pgzero_missed", "pgzero_merge_lost",
                    "pgzero_verify_failed", "pgzero_marked_reported", "pgzero_prezero_scans")
# below this growth (pages per second) the pre-zeroed pool counts as warm: 1 MiB/s
SETTLED_PAGES_PER_S = 256
# the in-kernel benchmark (kernel/bench/page-zeroed-bench.patch)
BENCH_RUN = "/sys/module/page_zeroed_bench/parameters/run"
BENCH_PROG = "page_zeroed_bench"
USER_HZ = 100


def thp(mode: str) -> str:
    """Set transparent huge pages to `mode` where the kernel has them (not UML)."""
    return f"[ -w {THP_ENABLED} ] && echo {mode} > {THP_ENABLED} || true"


def pcp_high_fraction(fraction: int) -> str:
    """Small per-cpu lists: freed pages reach the free lists (and reporting)."""
    return f"echo {fraction} > {PCP_HIGH_FRACTION}"


def flush_cmd(pages: int = 1000000) -> str:
    """Guest shell: report up to `pages` free pages now and wait for it.

    ENODATA means a pass had already reported everything (the series
    reports within 100 ms of a free), which is fine; any other error (no
    device, the device failed) ends the script.
    """
    return (f'out=$( (echo {pages} > {FLUSH}) 2>&1 ) || case "$out" in '
            f'*"No data available"*) ;; *) echo "flush: $out" >&2; exit 1;; esac')


def flush_if_present() -> str:
    """Report now on the series; stock has no flush (its 2 s timer reports)."""
    return f"[ -w {FLUSH} ] && echo 1000000 > {FLUSH} || true"


def reporting_snapshot() -> str:
    """Shell function `reporting TAG`: one JSON line with the series'
    counters (reported_pages summed over orders; null for a counter an
    older series lacks), the delay in force and delay_ms; nothing on stock."""
    r = REPORTING_DIR
    names = (*REPORTING_COUNTERS, "current_delay_ms", "delay_ms")
    fields = ",".join(f'"{c}":%s' for c in names)
    values = " ".join('"$(awk \'{s=0; for (i = 1; i <= NF; i++) s += $i; print s}\' $R/' + c + ')"'
                      if c == "reported_pages" else
                      f'"$(cat {REPORTING_SYSFS}/{c})"' if c in REPORTING_TUNABLES else
                      f'"$(cat $R/{c} 2>/dev/null || echo null)"'
                      for c in names)
    return "\n".join([
        "reporting() {",
        f"\t[ -r {r}/passes ] || return 0",
        f"\tR={r}",
        f"\tprintf '{{\"prog\":\"reporting\",\"tag\":\"%s\",{fields}}}\\n' \"$1\" {values}",
        "}",
    ])


# the reporting order: a module parameter, on stock 6.12 and on the series
REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
MEMSTATE_PROG = "memstate"


def memstate_function() -> str:
    """Shell function `memstate TAG`: one JSON line with where the guest's
    free memory is: free blocks per order over all zones (/proc/buddyinfo),
    pages on the per-cpu lists (the pagesets' `count:` in /proc/zoneinfo),
    MemFree (KiB) and the reporting order (-1 unknown)."""
    return "\n".join([
        "memstate() {",
        "\tb=$(awk '{for (i = 5; i <= NF; i++) s[i-5] += $i; if (NF - 5 > n) n = NF - 5}"
        " END {for (i = 0; i <= n; i++) printf \"%s%d\", (i ? \",\" : \"\"), s[i]}' /proc/buddyinfo)",
        "\tp=$(awk '$1 == \"count:\" {s += $2} END {print s + 0}' /proc/zoneinfo)",
        "\tf=$(awk '$1 == \"MemFree:\" {print $2}' /proc/meminfo)",
        f"\to=$(cat {REPORTING_ORDER} 2>/dev/null || echo -1)",
        f"\tprintf '{{\"prog\":\"{MEMSTATE_PROG}\",\"tag\":\"%s\",\"free_blocks\":[%s],"
        "\"pcp_pages\":%s,\"memfree_kib\":%s,\"reporting_order\":%s}\\n' "
        "\"$1\" \"$b\" \"$p\" \"$f\" \"$o\"",
        "}",
    ])


def reporting_tracer(period_ms: int) -> str:
    """Guest shell: `reporting "t=<uptime>"` every `period_ms` in the
    background, its pid in $tracer (needs reporting_snapshot())."""
    pause = f"{period_ms // 1000}.{period_ms % 1000:03d}"
    return (f"( while :; do reporting \"t=$(cut -d' ' -f1 /proc/uptime)\"; sleep {pause}; "
            "done ) & tracer=$!")


def reporting_counters() -> str:
    """One COUNTER_TAG line per counter the kernel has (none on stock)."""
    names = " ".join(REPORTING_COUNTERS)
    return (f"for f in {names}; do [ -r {REPORTING_DIR}/$f ] && "
            f"echo \"{COUNTER_TAG} $f $(cat {REPORTING_DIR}/$f)\"; done; true")


def vmstat_save(counters: tuple[str, ...], to: str) -> str:
    """Save the lines of `counters` (/proc/vmstat and the series' counters)
    to a file."""
    return f"{VMSTAT_ALL} | grep -E '^({'|'.join(counters)}) ' > {to} || true"


def vmstat_delta(extra: str = "", before: str = "/tmp/v0", after: str = "/tmp/v1") -> str:
    """One JSON line {"prog":"vmstat"<extra>,"<counter>":<delta>...} from two
    vmstat_save() files; `extra` is JSON text such as ',"mode":"4k"'."""
    head = '{"prog":"vmstat"' + extra
    head = head.replace('"', '\\"')
    return ("awk 'NR==FNR{a[$1]=$2;next}{s=s sprintf(\",\\\"%s\\\":%d\",$1,$2-a[$1])}"
            f"END{{print \"{head}\" s \"}}\"}}' {before} {after}")


def bench_function(who: str) -> str:
    """Shell function `bench ARGS`: one in-kernel benchmark command, its
    JSON line copied out of the ring buffer (dmesg -c) to stdout."""
    return "\n".join([
        "bench() {",
        "\tdmesg -c > /dev/null",
        f"\techo \"$*\" > {BENCH_RUN} || {{ echo \"{who}: '$*' failed\" >&2; exit 4; }}",
        f"\tdmesg -c | sed -n 's/^.*\\({{\"prog\":\"{BENCH_PROG}\".*}}\\)[[:space:]]*$/\\1/p'",
        "}",
    ])


def prezero_helpers(stable_s: int = 3) -> str:
    """Shell functions of every pre-zeroing guest script.

    vm: the counters on one line; ev NAME MODE: an event line with them;
    knob NAME VALUE: set a pre-zeroing knob if the kernel has it;
    prezero_wait TIMEOUT: until the thread's counters grew by less than
    SETTLED_PAGES_PER_S a second for `stable_s` seconds in a row (the poll
    itself forks and frees a few dirty pages each second, which the thread
    clears, so they never stand quite still; without a thread: after that
    idle time), prints "<EVENT> waited <mode> seconds <n>".
    """
    counters = "|".join(PREZERO_COUNTERS)
    return f"""vm() {{ {VMSTAT_ALL} | grep -E '^({counters}) ' | tr '\\n' ' '; }}
ev() {{ echo "{EVENT} $1 $2 $(vm)"; }}
knob() {{ if [ -w {PREZERO_DIR}/$1 ]; then echo $2 > {PREZERO_DIR}/$1; fi; }}
prezero_wait() {{
\tprev=-1; stable=0; waited=0
\twhile [ $stable -lt {stable_s} ] && [ $waited -lt $1 ]; do
\t\tsleep 1; waited=$((waited + 1))
\t\tcur=$({VMSTAT_ALL} | \\
\t\t\tawk '/^pgzero_(marked_prezero|prezero_hugetlb) /{{s += $2}} END{{print s + 0}}')
\t\tif [ $((cur - prev)) -lt {SETTLED_PAGES_PER_S} ]; then stable=$((stable + 1))
\t\telse stable=0; fi
\t\tprev=$cur
\tdone
\techo "{EVENT} waited ${{2:-all}} seconds $waited"
}}
"""


def require_prezero(who: str) -> str:
    """End the script (exit 3) on a kernel without pre-zeroing."""
    return f"[ -d {PREZERO_DIR} ] || {{ echo '{who}: no {PREZERO_DIR}' >&2; exit 3; }}"


def kcpu_function() -> str:
    """Shell function kcpu: prints the CPU time in ns of the kprezerod
    threads (one per node with memory, kprezerod/<nid>), summed, and where
    it came from: "schedstat" (the scheduler's runtime, CONFIG_SCHED_INFO,
    which bench.config turns on; exact where sched_clock() is, e.g. x86,
    in jiffies on UML), "ticks" (utime + stime, which miss a thread that
    runs between ticks; so for the sum if one thread has no schedstat) or
    "none" (no thread yet: exactly 0)."""
    tick_ns = 10**9 // USER_HZ
    return "\n".join([
        "kcpu() {",
        "\tns=0; src=none",
        "\tfor s in /proc/[0-9]*/stat; do",
        "\t\tcase \"$(cat $s 2>/dev/null)\" in *'(kprezerod)'*|*'(kprezerod/'*)",
        "\t\t\tif [ -r ${s%/stat}/schedstat ] && [ $src != ticks ]; then",
        "\t\t\t\tns=$((ns + $(cut -d' ' -f1 ${s%/stat}/schedstat))); src=schedstat",
        "\t\t\telse",
        f"\t\t\t\tns=$((ns + $(awk '{{print ($14 + $15) * {tick_ns}}}' $s))); src=ticks",
        "\t\t\tfi;;",
        "\t\tesac",
        "\tdone",
        "\techo \"$ns $src\"",
        "}",
    ])


def kcpu_snapshot(prefix: str) -> str:
    """A shell line that echoes `prefix` followed by "cpu_ns N exact 0|1"
    (exact: not from ticks), for kcpu_function()'s kcpu."""
    return (f"set -- $(kcpu); echo \"{prefix} cpu_ns $1 exact "
            "$([ \"$2\" = ticks ] && echo 0 || echo 1)")


def cpustat_function() -> str:
    """Shell function `cpustat TAG`: the guest's /proc/stat cpu line as JSON
    ticks (user nice system idle iowait irq softirq steal)."""
    return ("cpustat() { awk -v tag=\"$1\" '$1 == \"cpu\" { printf \"{\\\"prog\\\":\\\"cpustat\\\","
            "\\\"tag\\\":\\\"%s\\\",\\\"ticks\\\":[%s,%s,%s,%s,%s,%s,%s,%s]}\\n\", "
            "tag, $2, $3, $4, $5, $6, $7, $8, $9 }' /proc/stat; }")

"""Pre-zeroing per NUMA node, and its CPU time in a cgroup an administrator chooses.

QEMU x86_64 guests with NUMA nodes of 512 MiB each (Plan.numa_nodes), two
vCPUs, a kernel with CONFIG_NUMA and the cgroup v2 cpu controller
(both in x86_64.config), no balloon (every order open to
pre-zeroing). The memory the guest booted with is free and not known to be
zero: each node's thread has its node's share to clear.
"""

from __future__ import annotations

import pytest

from freepage_lab import kernel, kunit
from freepage_lab.guestshell import PREZERO_DIR, ZEROED_NODE_STAT
from freepage_lab.guestshell import prezero_helpers as shell_helpers
from freepage_lab.initramfs import EVENT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel.Series.load().names, reason="kernel series is empty"),
]

SMP = 2
NODE_MIB = 512
NODE_DIR = "/sys/devices/system/node"
CGROUP = "/sys/fs/cgroup"


def threads_function() -> str:
    """Shell function `threads`: one event line per kprezerod thread, with
    its pid and the CPUs it may run on."""
    return ("threads() { for p in /proc/[0-9]*; do c=$(cat $p/comm 2>/dev/null); "
            "case \"$c\" in kprezerod*) echo \"" + EVENT + " thread $c ${p#/proc/} "
            "$(awk '/^Cpus_allowed_list/{print $2}' $p/status)\";; esac; done; }")


def nodes_script(nodes_n: int) -> str:
    nodes = " ".join(str(n) for n in range(nodes_n))
    return f"""{shell_helpers(3)}
{threads_function()}
[ -d {PREZERO_DIR} ] || {{ echo 'no {PREZERO_DIR}' >&2; exit 3; }}
[ -d {NODE_DIR}/node{nodes_n - 1} ] || {{ echo 'fewer than {nodes_n} nodes' >&2; exit 4; }}
nodevm() {{
\tfor n in {nodes}; do
\t\techo "{EVENT} nodevm $1 $n \\
$(awk '$3 == "MemFree:" {{print "memfree_kb", $4}}' {NODE_DIR}/node$n/meminfo) \\
$(grep -E '^pgzero_prezero_(cleared|remote) ' {ZEROED_NODE_STAT.format(nid='$n')} | tr '\\n' ' ')"
\tdone
}}
for n in {nodes}; do echo "{EVENT} nodecpus $n $(cat {NODE_DIR}/node$n/cpulist)"; done
nodevm start
echo 0 > {PREZERO_DIR}/min_order
echo 100 > {PREZERO_DIR}/cpu_percent
echo 1 > {PREZERO_DIR}/enabled
threads
ev start all
prezero_wait 240 all
ev warm all
nodevm warm
echo 0 > {PREZERO_DIR}/enabled
"""


def events(lines: list[str], kind: str) -> list[list[str]]:
    return [ln.split()[2:] for ln in lines if ln.startswith(f"{EVENT} {kind} ")]


def nodevm(lines: list[str], mark: str) -> dict[int, dict[str, int]]:
    """The node counters at `mark`: {node: {name: value}}."""
    out: dict[int, dict[str, int]] = {}
    for f in events(lines, "nodevm"):
        if f[0] == mark:
            out[int(f[1])] = {k: int(v) for k, v in zip(f[2::2], f[3::2])}
    return out


def boot_nodes(lab, name: str, script: str, nodes: int, cmdline: tuple[str, ...] = ()):
    """Two vCPUs, one on each of the first two nodes; nodes past those have
    memory only."""
    ctx = lab.context("qemu", patched=True)
    return lab.boot(ctx, name, script, lab.BARE, mem_mib=nodes * NODE_MIB, smp=SMP,
                    numa_nodes=nodes, cmdline=cmdline, timeout_s=480)


def test_prezero_clears_each_node_from_its_own_cpus_on_qemu(lab):
    """One kprezerod per node with memory, kprezerod/<nid>, allowed only on
    the CPUs of its node; each node's free memory cleared, and not a page of
    it by a CPU of another node (pgzero_prezero_remote, per node). Three
    nodes, two vCPUs: the third node has memory and no CPU, and no thread;
    nothing clears its memory ahead of time.

    With one global thread (allowed on every CPU, walking every node's
    zones) there was one thread, named kprezerod, with CPUs 0-1. When the
    memory-only node had a thread of its own, allowed on every CPU, it and
    node 0's thread kept giving CPU 0 up to each other: node 2 had 0 pages
    cleared, node 0 3072 of 125573 free, while node 1's thread, alone on
    its CPU, cleared 122737."""
    nodes = 3
    # loglevel 7 shows the KTAP lines of the KUnit suites the boot runs
    lines = boot_nodes(lab, "prezero-nodes", nodes_script(nodes), nodes, ("loglevel=7",)).lines
    print("\n".join(ln for ln in lines if ln.startswith(EVENT)))
    # the boot ran the KUnit suites, on two nodes
    res = kunit.parse(lines)
    assert res.suites.get("page_prezero", {}).get("pass", 0) > 0, res.suites
    assert not res.failed, (res.diagnostics or res.failed, res.suites)
    cpus = {int(f[0]): f[1] if len(f) > 1 else "" for f in events(lines, "nodecpus")}
    threads = {t[0]: t[2] for t in events(lines, "thread")}
    assert cpus == {0: "0", 1: "1", 2: ""}, (cpus, lines[-20:])
    want = {f"kprezerod/{n}": cpus[n] for n in range(nodes) if cpus[n]}
    assert threads == want, f"threads (name: allowed CPUs) {threads}, want {want}"
    start, warm = nodevm(lines, "start"), nodevm(lines, "warm")
    for n in range(nodes):
        free_pages = start[n]["memfree_kb"] // 4
        cleared = warm[n]["pgzero_prezero_cleared"] - start[n]["pgzero_prezero_cleared"]
        remote = warm[n]["pgzero_prezero_remote"] - start[n]["pgzero_prezero_remote"]
        assert remote == 0, f"node {n}: {remote} of {cleared} pages cleared by another node's CPU"
        if cpus[n]:
            # the free memory of the node, on the movable lists: most of it
            assert cleared >= free_pages // 2, \
                f"node {n}: {cleared} of {free_pages} free pages cleared"
        else:
            assert cleared == 0, f"node {n} has no CPU, yet {cleared} pages were cleared"
    print({n: {k: warm[n][k] - start[n].get(k, 0) for k in warm[n]} for n in warm})


WINDOW_S = 4
CAP_PERCENT = 20


def cgroup_script() -> str:
    group = f"{CGROUP}/prezero"
    stat = (f"awk '/^(usage_usec|nr_throttled) /{{printf \"%s %s \", $1, $2}}' {group}/cpu.stat; "
            "awk '{printf \"uptime_cs %d\", $1 * 100}' /proc/uptime")
    return f"""{shell_helpers(3)}
{threads_function()}
[ -d {PREZERO_DIR} ] || {{ echo 'no {PREZERO_DIR}' >&2; exit 3; }}
mkdir -p {CGROUP}
mount -t cgroup2 none {CGROUP} || {{ echo 'no cgroup2' >&2; exit 4; }}
echo +cpu > {CGROUP}/cgroup.subtree_control
mkdir {group}
echo "{CAP_PERCENT * 1000} 100000" > {group}/cpu.max
echo 0 > {PREZERO_DIR}/min_order
echo 100 > {PREZERO_DIR}/cpu_percent
# the threads start with the first enable and stay when it is turned off
echo 1 > {PREZERO_DIR}/enabled
echo 0 > {PREZERO_DIR}/enabled
threads
for p in /proc/[0-9]*; do
\tc=$(cat $p/comm 2>/dev/null)
\tcase "$c" in kprezerod*)
\t\tif echo ${{p#/proc/}} > {group}/cgroup.procs 2>/tmp/err; then r=moved
\t\telse r="refused $(cat /tmp/err)"; fi
\t\techo "{EVENT} move $c $r";;
\tesac
done
echo "{EVENT} procs $(cat {group}/cgroup.procs | tr '\\n' ' ')"
echo "{EVENT} cpustat before $({stat})"
ev start all
echo 1 > {PREZERO_DIR}/enabled
sleep {WINDOW_S}
echo "{EVENT} cpustat after $({stat})"
ev end all
echo 0 > {PREZERO_DIR}/enabled
"""


def test_prezero_threads_are_accounted_and_capped_in_a_cgroup_on_qemu(lab):
    """An administrator moves the kprezerod threads into a cgroup v2 group
    with the cpu controller and cpu.max at 20% of a CPU: both moves
    succeed, the group's cpu.stat usage grows while they clear, and the
    group is throttled, holding them near its cap.

    A thread bound with kthread_bind() is PF_NO_SETAFFINITY, which cgroup
    refuses to move (EINVAL); the threads are allowed on their node's CPUs
    with set_cpus_allowed_ptr() instead. With one global thread there was
    one thread to move, not one per node."""
    nodes = 2
    lines = boot_nodes(lab, "prezero-cgroup", cgroup_script(), nodes).lines
    threads = {t[0]: t[1] for t in events(lines, "thread")}
    moves = {m[0]: " ".join(m[1:]) for m in events(lines, "move")}
    procs = events(lines, "procs")
    assert sorted(threads) == [f"kprezerod/{n}" for n in range(nodes)], threads
    assert moves == {t: "moved" for t in threads}, moves
    assert procs and sorted(procs[0]) == sorted(threads.values()), (procs, threads)
    stats = {s[0]: {k: int(v) for k, v in zip(s[1::2], s[2::2])} for s in events(lines, "cpustat")}
    before, after = stats["before"], stats["after"]
    used_us = after["usage_usec"] - before["usage_usec"]
    window_us = (after["uptime_cs"] - before["uptime_cs"]) * 10_000
    throttled = after["nr_throttled"] - before["nr_throttled"]
    share = used_us / window_us
    print({"usage_us": used_us, "window_us": window_us, "share": round(share, 3),
           "nr_throttled": throttled})
    # their CPU time shows in the group: at least a tenth of the cap
    assert used_us >= window_us * CAP_PERCENT // 1000, (before, after)
    # and the group's cap holds them (cpu_percent 100 would let each take a CPU)
    assert throttled > 0, (before, after)
    assert share <= CAP_PERCENT / 100 * 1.5, f"{share:.3f} of a CPU with cpu.max at {CAP_PERCENT}%"

"""libvirt runs the freepage guest of docs/libvirt/freepage-guest.xml.

Two Debian 12 roots with the packages installed (debroot.install_root),
each with its own libvirtd (libvirt 11.3 from bookworm-backports) in a
mount namespace of its own: its own /etc/libvirt (a host UUID each), /run
and /var/lib/libvirt, so the two daemons are two hosts to libvirt. The
host's virsh talks to both over their sockets. The domain is the
documented XML (the packaged QEMU and kernel, reporting through
`freePageReporting='on'`, hinting and bits 6/7 through `<qemu:override>`,
`virtio_balloon.device_init=1`), TCG, with the lab's initramfs and a
console file; its RAM is a shared file, so the host can read it.

`virsh start`: the guest negotiates the bits and reports (its counters),
`virsh dommemstat` shows the balloon's statistics. `virsh migrate --live`
to the other daemon with hinting on, the destination left paused
(`--suspend`): its RAM must equal the source's, page for page (the
source's RAM file is kept by a hard link when libvirt ends the source).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_packages_install import built_debs

from freepage_lab import cli, debroot, guestshell, harness, libvirtxml, paths
from freepage_lab.guestram import differing_pages
from freepage_lab.initramfs import EVENT
from freepage_lab.scenarios import migrate
from freepage_lab.shell import LabError, Shell

pytestmark = pytest.mark.slow

DOMAIN_XML = paths.REPO / "docs" / "libvirt" / "freepage-guest.xml"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
MEM_MIB = 512
INITRD = "/var/lib/libvirt/images/freepage-initrd.img"
CONSOLE = "/var/log/libvirt/qemu/freepage-console.log"
MIGRATION_PORT = 49200

QEMU_CONF = """# the test's daemon: QEMU as root, no labels, no cgroups or namespaces
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
# QEMU's stdout and stderr to a file, not through virtlogd (not running here)
stdio_handler = "file"
cgroup_controllers = [ ]
namespaces = [ ]
migration_port_min = {port}
migration_port_max = {port_max}
"""


class Libvirtd:
    """libvirtd in `root`, in a mount namespace of its own."""

    def __init__(self, root: Path, name: str, port: int) -> None:
        self.root = root
        self.name = name
        self.host_uuid = str(uuid.uuid4())
        self.socket = root / "run" / "libvirt" / "libvirt-sock"
        self.uri = f"qemu:///system?socket={self.socket}"
        self.log = root.parent / f"{name}-libvirtd.log"
        etc = root / "etc" / "libvirt"
        (etc / "libvirtd.conf").write_text(
            f'host_uuid = "{self.host_uuid}"\nlog_outputs = "3:stderr"\n')
        (etc / "qemu.conf").write_text(QEMU_CONF.format(port=port, port_max=port + 9))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        mount = ('mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && '
                 'mount --rbind /sys "$0/sys" && exec chroot "$0" /usr/sbin/libvirtd')
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount,
                str(self.root)]
        Shell().show(argv)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"libvirtd {self.name} did not start; see {self.log}:\n"
                               + self.log.read_text(errors="replace")[-2000:])
            time.sleep(0.2)

    def virsh(self, *args: str, check: bool = True) -> str:
        argv = ["virsh", "-c", self.uri, *args]
        Shell().show(argv)
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
        if check and proc.returncode != 0:
            raise LabError(f"virsh {args[0]} ({self.name}) failed: {proc.stderr.strip()}")
        return proc.stdout

    def stop(self) -> None:
        """Destroy its domains, end the daemon, then anything left in its root."""
        if self.proc is not None and self.proc.poll() is None:
            self.virsh("destroy", "freepage", check=False)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in processes_in(self.root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def processes_in(root: Path) -> list[int]:
    """Processes whose root directory is `root` (QEMU daemonizes away from libvirtd)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(d / "root") == str(root):
                    out.append(int(d.name))
    return out


def domain_xml(kernel: str) -> str:
    """The documented domain with the test's kernel, memory, a console file and
    RAM in a shared file."""
    ET.register_namespace("qemu", QEMU_NS)
    dom = ET.parse(DOMAIN_XML).getroot()
    mem = dom.find("memory")
    assert mem is not None
    mem.text = str(MEM_MIB)
    os_el = dom.find("os")
    assert os_el is not None
    os_el.find("kernel").text = kernel  # type: ignore[union-attr]
    os_el.find("initrd").text = INITRD  # type: ignore[union-attr]
    backing = ET.SubElement(dom, "memoryBacking")
    ET.SubElement(backing, "source", type="file")
    ET.SubElement(backing, "access", mode="shared")
    devices = dom.find("devices")
    assert devices is not None
    for tag in ("serial", "console"):
        for el in devices.findall(tag):
            devices.remove(el)
    serial = ET.SubElement(devices, "serial", type="file")
    ET.SubElement(serial, "source", path=CONSOLE)
    ET.SubElement(serial, "target", port="0")
    return ET.tostring(dom, encoding="unicode")


def console(root: Path) -> str:
    path = root / CONSOLE.lstrip("/")
    return path.read_text(errors="replace") if path.exists() else ""


def wait_console(root: Path, pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = re.search(pattern, console(root), re.M)
        if m:
            return m
        if time.monotonic() > deadline:
            raise LabError(f"no {pattern!r} on the console within {timeout_s} s:\n"
                           + console(root)[-3000:])
        time.sleep(1)


def ram_file(root: Path) -> Path:
    files = sorted((root / "var" / "lib" / "libvirt" / "qemu" / "ram").rglob("*"))
    files = [f for f in files if f.is_file()]
    assert len(files) == 1, files
    return files[0]


# the migrate scenario's idle guest with hinting, reporting and the device's
# zeroing ("hint-reported"): it fills and frees memory, reports it, and
# beats once a second; the lab migrates the same guest for its figures
PARAMS = migrate.MigrateParams(mem_mib=MEM_MIB, fill_mib=256, rounds=1)
LAB_VARIANT = harness.FAMILIES["migrate"]["hint-reported"]
GUEST_SCRIPT = (f'echo "features {guestshell.BALLOON_FEATURES}"\n'
                + migrate.guest_script(PARAMS, "idle", flush=True).replace(
                    f"echo {EVENT} ready", f"{guestshell.reporting_counters()}\necho {EVENT} ready"))
# QMP for the capability libvirt has no flag for (the lab's sources set it too)
FIRST_PASS = ('{"execute":"migrate-set-capabilities","arguments":{"capabilities":'
              f'[{{"capability":"{migrate.FIRST_PASS_CAP}","state":true}}]}}}}')


def test_libvirt_starts_reports_and_migrates_page_for_page(lab, tmp_path):
    if shutil.which("virsh") is None:
        pytest.skip("no virsh on the host (libvirt-clients)")
    debs = built_debs(tmp_path)
    ctx = lab.context("qemu", patched=True, patched_qemu=True)
    initrd = ctx.initrd("libvirt", GUEST_SCRIPT)
    daemons = []
    try:
        for i, name in enumerate(("src", "dst")):
            root = debroot.install_root(Shell(), debs, tmp_path / name)
            dest = root / INITRD.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(initrd, dest)
            daemons.append(Libvirtd(root, name, MIGRATION_PORT + 10 * i))
        for d in daemons:
            d.start()
        src, dst = daemons
        kernel = "/" + str(next((src.root / "boot").glob("vmlinuz-*-freepage"))
                           .relative_to(src.root))
        enable_on_an_existing_domain(src, kernel, tmp_path)
        xml = tmp_path / "freepage.xml"
        xml.write_text(domain_xml(kernel))
        src.virsh("create", str(xml))
        m = wait_console(src.root, r"^features ([01]+)", 300)
        features = m.group(1)
        assert features[6] == "1" and features[7] == "1", features
        assert features[3] == "1" and features[5] == "1", features
        wait_console(src.root, rf"^{EVENT} ready", 300)
        counters = re.search(rf"^{guestshell.COUNTER_TAG} reported_pages (.*)$",
                             console(src.root), re.M)
        assert counters and sum(map(int, counters.group(1).split())) > 0, console(src.root)
        time.sleep(5)
        stats = src.virsh("dommemstat", "freepage")
        print(stats)
        assert re.search(r"^unused \d+", stats, re.M), stats
        kept = tmp_path / "src-ram"
        os.link(ram_file(src.root), kept)
        src.virsh("qemu-monitor-command", "freepage", FIRST_PASS)
        src.virsh("migrate", "--live", "--suspend", "--auto-converge", "--verbose",
                  "--bandwidth", str(PARAMS.max_bandwidth_mib_s), "freepage", dst.uri,
                  f"tcp://127.0.0.1:{MIGRATION_PORT + 10}")
        job = dst.virsh("domjobinfo", "--completed", "freepage", check=False)
        print(f"virsh domjobinfo --completed (destination):\n{job}")
        differ, where = differing_pages(kept, ram_file(dst.root))
        print(f"{differ} pages differ (first at {', '.join(hex(g) for g in where) or '-'})")
        assert differ == 0, where
        dst.virsh("resume", "freepage")
        beats = rf"^{EVENT} alive"
        before = len(re.findall(beats, console(dst.root), re.M))
        time.sleep(10)
        assert len(re.findall(beats, console(dst.root), re.M)) > before, console(dst.root)
    finally:
        for d in reversed(daemons):
            d.stop()
    # the same guest migrated by the lab (QMP, the same parameters)
    lab_figures = migrate.Migrate().one(ctx, PARAMS, "precopy", "idle", LAB_VARIANT, 0)
    print(figures_table(jobinfo(job), lab_figures))


def enable_on_an_existing_domain(daemon: Libvirtd, kernel: str, tmp_path: Path) -> None:
    """`freepage libvirt-enable` on a plain domain: libvirt takes the edit and
    keeps every property of it."""
    plain = tmp_path / "plain.xml"
    plain.write_text(f"""<domain type='qemu'><name>plain</name><memory unit='MiB'>256</memory>
<vcpu>1</vcpu><os><type arch='x86_64' machine='pc'>hvm</type><kernel>{kernel}</kernel>
<cmdline>console=ttyS0</cmdline></os>
<devices><memballoon model='virtio'/></devices></domain>""")
    daemon.virsh("define", str(plain))
    assert cli.main(["libvirt-enable", "plain", "--connect", daemon.uri]) == 0
    xml = daemon.virsh("dumpxml", "--inactive", "plain")
    daemon.virsh("undefine", "plain")
    for want in ("freePageReporting='on'", "<iothreads>1</iothreads>",
                 "virtio_balloon.device_init=1", libvirtxml.EMULATOR,
                 *(f"name='{p}'" for p in libvirtxml.properties(True, True, "iothread1"))):
        assert want.replace("'", '"') in xml or want in xml, (want, xml)


def jobinfo(text: str) -> dict[str, float]:
    """virsh domjobinfo's "Name: value unit" lines that the table shows."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        words = value.split()
        if words and re.fullmatch(r"[0-9.]+", words[0]):
            scale = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}.get(words[1] if len(words) > 1 else "",
                                                                   1)
            out[name.strip()] = float(words[0]) * scale
    return out


def figures_table(libvirt: dict[str, float], lab: dict) -> str:
    rows = [("total time (ms)", libvirt.get("Time elapsed"), lab.get("total_time_ms")),
            ("downtime (ms)", libvirt.get("Total downtime"), lab.get("downtime_ms")),
            ("RAM transferred (MiB)", libvirt.get("Memory processed"), lab.get("transferred_mib")),
            ("used by the guest (MiB)", None, lab.get("used_mib"))]
    lines = [f"{'the same guest, precopy, hinting on':36s} {'libvirt':>10s} {'lab':>10s}"]
    for name, a, b in rows:
        lines.append(f"{name:36s} {'-' if a is None else f'{a:.0f}':>10s} "
                     f"{'-' if b is None else f'{b:.0f}':>10s}")
    return "\n".join(lines)

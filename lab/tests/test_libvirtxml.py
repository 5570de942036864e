"""freepage libvirt-enable's XML edit (libvirtxml.enable)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from freepage_lab import libvirtxml, paths
from freepage_lab.shell import LabError

Q = f"{{{libvirtxml.QEMU_NS}}}"
PLAIN = """<domain type='kvm'>
  <name>vm1</name>
  <memory unit='MiB'>1024</memory>
  <vcpu>2</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type><kernel>/boot/vmlinuz</kernel>
    <cmdline>console=ttyS0</cmdline></os>
  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator>
    <memballoon model='virtio'/></devices>
</domain>"""


def props(dom: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "")
            for p in dom.iter(f"{Q}property")}


def test_enable_turns_on_what_the_documented_domain_has() -> None:
    dom = ET.fromstring(libvirtxml.enable(PLAIN))
    documented = ET.parse(paths.REPO / "docs" / "libvirt" / "freepage-guest.xml").getroot()
    assert props(dom) == props(documented)
    assert dom.findtext("devices/emulator") == documented.findtext("devices/emulator")
    assert dom.find("devices/memballoon").get("freePageReporting") == "on"  # type: ignore[union-attr]
    assert dom.findtext("iothreads") == "1"
    assert [e.tag for e in dom][:4] == ["name", "memory", "vcpu", "iothreads"]
    assert dom.findtext("os/cmdline") == "console=ttyS0 virtio_balloon.device_init=1"


def test_enable_twice_is_enable_once() -> None:
    once = libvirtxml.enable(PLAIN)
    assert libvirtxml.enable(once) == once


def test_without_hint_and_bits_only_reporting_is_on() -> None:
    dom = ET.fromstring(libvirtxml.enable(PLAIN, hint=False, device_init=False))
    assert props(dom) == {}
    assert dom.find("iothreads") is None
    assert dom.findtext("os/cmdline") == "console=ttyS0"


@pytest.mark.parametrize("xml, why", [
    ("<domain><devices><memballoon model='none'/></devices></domain>", "model='none'"),
    ("<network/>", "not a libvirt domain"),
    ("<domain", "does not parse"),
])
def test_bad_domains_are_refused(xml: str, why: str) -> None:
    with pytest.raises(LabError, match=why):
        libvirtxml.enable(xml)

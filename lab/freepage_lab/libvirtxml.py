"""Turn freepage on in an existing libvirt domain's XML.

    freepage libvirt-enable DOMAIN [--connect URI] [--no-hint] [--no-device-init]

reads the domain with `virsh dumpxml`, and writes it back with `virsh
define` (the change takes effect at the next start) with what
docs/libvirt/freepage-guest.xml has: the packaged QEMU as emulator, the
balloon with `freePageReporting='on'`, an iothread, free page hinting and
the experimental bits 6/7 as `<qemu:override>` properties of the balloon,
and `virtio_balloon.device_init=1` on a direct-kernel-boot command line
(a guest that boots through its own boot loader needs it in its own
configuration). `--dry-run` prints the new XML and defines nothing.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from .shell import LabError

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
EMULATOR = "/usr/bin/qemu-system-x86_64-freepage"
BALLOON_ALIAS = "balloon0"
OPT_IN = "virtio_balloon.device_init=1"


def _child(parent: ET.Element, tag: str, **attrs: str) -> ET.Element:
    el = parent.find(tag)
    if el is None:
        el = ET.SubElement(parent, tag)
    el.attrib.update(attrs)
    return el


def properties(hint: bool, device_init: bool, iothread: str) -> dict[str, tuple[str, str]]:
    """The balloon's QEMU properties: name -> (type, value)."""
    props: dict[str, tuple[str, str]] = {}
    if hint:
        props["free-page-hint"] = ("bool", "true")
        props["iothread"] = ("string", iothread)
    if device_init:
        props["x-device-init-reported"] = ("bool", "true")
        props["x-device-init-on-inflate"] = ("bool", "true")
    return props


def enable(xml: str, hint: bool = True, device_init: bool = True,
           emulator: str = EMULATOR) -> str:
    """The domain XML `xml` with freepage turned on (see the module doc)."""
    ET.register_namespace("qemu", QEMU_NS)
    try:
        dom = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise LabError(f"domain XML does not parse: {exc}") from exc
    if dom.tag != "domain":
        raise LabError(f"not a libvirt domain: the root element is <{dom.tag}>")
    devices = _child(dom, "devices")
    _child(devices, "emulator").text = emulator
    balloons = devices.findall("memballoon")
    if any(b.get("model") == "none" for b in balloons):
        raise LabError("the domain has <memballoon model='none'>: give it a virtio balloon first")
    balloon = balloons[0] if balloons else ET.SubElement(devices, "memballoon")
    balloon.set("model", "virtio")
    balloon.set("freePageReporting", "on")
    iothread = "iothread1"
    if hint:
        threads = dom.find("iothreads")
        if threads is None:
            threads = ET.Element("iothreads")
            threads.text = "1"
            # libvirt's schema wants it among the first elements: after <vcpu>
            vcpu = dom.find("vcpu")
            index = list(dom).index(vcpu) + 1 if vcpu is not None else len(dom)
            dom.insert(index, threads)
    props = properties(hint, device_init, iothread)
    override = dom.find(f"{{{QEMU_NS}}}override")
    if override is None:
        override = ET.SubElement(dom, f"{{{QEMU_NS}}}override")
    device = next((d for d in override.findall(f"{{{QEMU_NS}}}device")
                   if d.get("alias") == BALLOON_ALIAS), None)
    if device is None:
        device = ET.SubElement(override, f"{{{QEMU_NS}}}device", alias=BALLOON_ALIAS)
    frontend = device.find(f"{{{QEMU_NS}}}frontend")
    if frontend is None:
        frontend = ET.SubElement(device, f"{{{QEMU_NS}}}frontend")
    for old in frontend.findall(f"{{{QEMU_NS}}}property"):
        if old.get("name") in props:
            frontend.remove(old)
    for name, (kind, value) in props.items():
        ET.SubElement(frontend, f"{{{QEMU_NS}}}property", name=name, type=kind, value=value)
    os_el = dom.find("os")
    if device_init and os_el is not None and os_el.find("kernel") is not None:
        cmdline = _child(os_el, "cmdline")
        words = (cmdline.text or "").split()
        if OPT_IN not in words:
            cmdline.text = " ".join([*words, OPT_IN])
    return ET.tostring(dom, encoding="unicode")

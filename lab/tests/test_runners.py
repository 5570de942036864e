from pathlib import Path

import pytest

from freepage_lab import runners
from freepage_lab.runners import GuestConfig, QemuRunner, UmlRunner
from freepage_lab.shell import LabError, Shell


def cfg(**kw):
    return GuestConfig(kernel=Path("/k"), initrd=Path("/i"), **kw)


def test_qemu_argv_reporting_on_by_default():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(mem_mib=1024))
    assert argv[0] == "qemu-system-x86_64"
    assert "pc,accel=tcg" in argv and "max" in argv
    assert "virtio-balloon-pci,id=balloon0,free-page-reporting=on" in argv
    assert argv[argv.index("-m") + 1] == "1024M"
    assert "-no-reboot" in argv
    append = argv[argv.index("-append") + 1]
    assert "console=ttyS0" in append and "panic=-1" in append and "fp.halt=reboot" in append


def test_qemu_argv_hint_needs_iothread_and_qmp_incoming():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(
        free_page_reporting=False, free_page_hint=True, qmp_socket=Path("/q.sock"),
        incoming="tcp:127.0.0.1:4444"))
    assert "iothread,id=balloon-io" in argv
    assert "virtio-balloon-pci,id=balloon0,free-page-hint=on,iothread=balloon-io" in argv
    assert "unix:/q.sock,server=on,wait=off" in argv
    assert argv[argv.index("-incoming") + 1] == "tcp:127.0.0.1:4444"


def test_qemu_without_balloon():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(balloon=False))
    assert not any("virtio-balloon" in a for a in argv)


def test_uml_argv_attaches_vhost_user_balloon():
    argv = UmlRunner(Shell()).argv(cfg(mem_mib=256, vhost_user_balloon=Path("/tmp/b.sock")))
    assert argv[:3] == ["/k", "mem=256M", "initrd=/i"]
    assert "virtio_uml.device=/tmp/b.sock:5" in argv
    assert "fp.halt=poweroff" in argv


def test_kvm_refused_under_pvm(monkeypatch):
    monkeypatch.setattr(runners.os.path, "exists", lambda p: True)
    monkeypatch.setattr(runners.os.path, "isdir", lambda p: p == "/sys/module/kvm_pvm")
    ok, why = runners.kvm_usable()
    assert not ok and "PVM" in why


def test_auto_accel_is_tcg_without_hardware_kvm(monkeypatch):
    monkeypatch.setattr(runners, "kvm_usable", lambda: (False, "no /dev/kvm"))
    r = QemuRunner(Shell(), accel="auto")
    assert r.accel == "tcg"
    assert "no /dev/kvm" in r.accel_reason


def test_qemu_stock_binary_is_found_on_path_and_needs_no_firmware_dirs():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg())
    assert argv[0] == str(runners.STOCK_QEMU) == "qemu-system-x86_64"
    assert "-L" not in argv


def test_qemu_patched_binary_takes_debian_firmware_and_init_bits():
    r = QemuRunner(Shell(), accel="tcg", binary=Path("/cache/qemu/build/qemu-system-x86_64"))
    argv = r.argv(cfg(device_init_reported=True, device_init_on_inflate=True))
    assert argv[0] == "/cache/qemu/build/qemu-system-x86_64"
    dirs = [argv[i + 1] for i, a in enumerate(argv) if a == "-L"]
    assert dirs == ["/usr/share/qemu", "/usr/share/seabios", "/usr/lib/ipxe/qemu"]
    assert ("virtio-balloon-pci,id=balloon0,free-page-reporting=on,x-device-init-reported=on,"
            "x-device-init-on-inflate=on") in argv


def test_qemu_vhost_user_balloon_replaces_virtio_balloon_and_shares_ram():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(
        mem_mib=1024, vhost_user_balloon=Path("/run/b.sock")))
    assert not any(a.startswith("virtio-balloon") for a in argv)
    assert argv[argv.index("-machine") + 1] == "pc,accel=tcg,memory-backend=mem"
    assert "memory-backend-memfd,id=mem,size=1024M,share=on" in argv
    assert "socket,id=vub,path=/run/b.sock" in argv
    assert argv[argv.index("-device") + 1] == "vhost-user-balloon-pci,chardev=vub"


def test_qemu_shared_memfd_ram_keeps_the_virtio_balloon():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(mem_mib=1024, shared_memfd=True))
    assert argv[argv.index("-machine") + 1] == "pc,accel=tcg,memory-backend=mem"
    assert "memory-backend-memfd,id=mem,size=1024M,share=on" in argv
    assert argv[argv.index("-device") + 1].startswith("virtio-balloon-pci,")


def test_qemu_numa_nodes_split_memory_and_cpus():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(mem_mib=1024, smp=2, numa_nodes=2))
    assert argv[argv.index("-machine") + 1] == "pc,accel=tcg"
    opts = [argv[i + 1] for i, a in enumerate(argv) if a in ("-object", "-numa")]
    assert opts[:4] == ["memory-backend-ram,size=512M,id=ram0", "node,nodeid=0,memdev=ram0,cpus=0-0",
                        "memory-backend-ram,size=512M,id=ram1", "node,nodeid=1,memdev=ram1,cpus=1-1"]
    assert argv[argv.index("-m") + 1] == "1024M"


def test_qemu_numa_node_past_the_cpus_has_memory_only_and_shared_ram():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(mem_mib=1024, numa_nodes=2,
                                                     shared_memfd=True))
    # the per-node backends replace the machine's single one
    assert argv[argv.index("-machine") + 1] == "pc,accel=tcg"
    assert "memory-backend-memfd,size=512M,share=on,id=ram1" in argv
    assert "node,nodeid=0,memdev=ram0,cpus=0-0" in argv
    assert "node,nodeid=1,memdev=ram1" in argv


def test_numa_nodes_refused_where_the_platform_has_none():
    with pytest.raises(LabError, match="does not split|split evenly"):
        QemuRunner(Shell(), accel="tcg").argv(cfg(mem_mib=1000, numa_nodes=3))
    with pytest.raises(LabError, match="UML"):
        UmlRunner(Shell()).argv(cfg(numa_nodes=2))


def test_qemu_root_disk_is_virtio_blk_with_snapshot_and_named_to_the_init():
    argv = QemuRunner(Shell(), accel="tcg").argv(cfg(root_disk=Path("/img/root.ext4")))
    drive = argv[argv.index("-drive") + 1]
    assert drive.startswith("file=/img/root.ext4,") and "snapshot=on" in drive
    assert "format=raw" in drive
    assert "virtio-blk-pci,drive=root" in argv
    assert "fp.root=/dev/vda" in argv[argv.index("-append") + 1].split()
    plain = QemuRunner(Shell(), accel="tcg").argv(cfg())
    assert "-drive" not in plain and "fp.root" not in plain[plain.index("-append") + 1]


def test_root_disk_refused_where_the_platform_has_none():
    with pytest.raises(LabError, match="root disk"):
        UmlRunner(Shell()).argv(cfg(root_disk=Path("/r")))
    with pytest.raises(LabError, match="root disks"):
        runners.Arm64Runner(Shell()).argv(cfg(root_disk=Path("/r")))


def test_qemu_guest_larger_than_host_ram_is_not_reserved():
    # 128 GiB on a host with 24 GiB of RAM and swap: the heuristic overcommit
    # would refuse the mapping, so RAM is a backend with reserve=off
    argv = QemuRunner(Shell(), accel="tcg", commit_limit_mib=24 * 1024).argv(
        cfg(mem_mib=128 * 1024))
    assert "memory-backend-ram,size=131072M,reserve=off,id=mem" in argv
    assert "pc,accel=tcg,memory-backend=mem" in argv
    assert argv[argv.index("-m") + 1] == "131072M"


def test_qemu_guest_within_host_ram_keeps_its_command_line():
    argv = QemuRunner(Shell(), accel="tcg", commit_limit_mib=24 * 1024).argv(cfg(mem_mib=8192))
    assert not any("reserve=off" in a or "memory-backend" in a for a in argv)
    assert "pc,accel=tcg" in argv


def test_qemu_numa_nodes_of_a_guest_larger_than_host_ram_are_not_reserved():
    argv = QemuRunner(Shell(), accel="tcg", commit_limit_mib=1024).argv(
        cfg(mem_mib=4096, numa_nodes=2, smp=2))
    backends = [a for a in argv if a.startswith("memory-backend-ram")]
    assert backends == ["memory-backend-ram,size=2048M,reserve=off,id=ram0",
                        "memory-backend-ram,size=2048M,reserve=off,id=ram1"]
    assert "pc,accel=tcg" in argv

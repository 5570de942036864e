"""The host check: what /proc/cpuinfo and ptrace say, and what it concludes."""

import dataclasses
import os
from pathlib import Path

import pytest

from freepage_lab import hostcheck, kernel
from freepage_lab.hostcheck import HostFacts

DATA = Path(__file__).parent / "data"


def amd_host(**changes) -> HostFacts:
    """This lab's AMD EPYC as `freepage host` found it (2440-byte area)."""
    model, cpus, flags = hostcheck.parse_cpuinfo((DATA / "cpuinfo-amd-epyc.txt").read_text())
    base = HostFacts(model, "x86_64", cpus, flags, 2440, "", "/dev/shm", "", False,
                     "/dev/kvm is PVM", {"qemu-system-x86_64": "10.0.2",
                                         "qemu-system-aarch64": "10.0.2"})
    return dataclasses.replace(base, **changes)


def test_cpuinfo_gives_model_cpus_and_the_flags_that_size_xsave():
    model, cpus, flags = hostcheck.parse_cpuinfo((DATA / "cpuinfo-amd-epyc.txt").read_text())
    assert (model, cpus) == ("AMD EPYC", 2)
    assert flags["xsave"] and flags["pku"] and not flags["amx_tile"] and not flags["avx512f"]
    # a Sapphire Rapids guest's flags line (a sample of the generation, not a recording)
    model, _, flags = hostcheck.parse_cpuinfo((DATA / "cpuinfo-xeon-amx.txt").read_text())
    assert "Xeon" in model and flags["amx_tile"] and flags["avx512f"]


def test_an_amx_host_is_fine_with_the_platform_patch_and_says_why_without():
    amx = amd_host(cpu_model="Intel(R) Xeon(R) Platinum 8481C", xstate_bytes=11008)
    assert amx.stock_uml_fails and amx.uml_platform_fix and amx.problems() == []
    said = "\n".join(amx.lines())
    assert "11008 bytes, more than the 2696 stock 6.12 UML passes: it fails here" in said
    assert "carry kernel/platform/um" in said
    small = amd_host()
    assert not small.stock_uml_fails
    assert "2440 bytes, within the 2696" in "\n".join(small.lines())


def test_without_the_platform_patch_an_amx_host_is_one_line(monkeypatch):
    monkeypatch.setattr(kernel, "PLATFORM_QUEUES", {})
    amx = amd_host(xstate_bytes=11008)
    assert amx.problems() == ["UML cannot run: the host's XSAVE area is 11008 bytes, 6.12 UML "
                              "passes 2696 (kernel/platform/um is missing)"]


def test_ptrace_refused_or_noexec_tmp_or_no_qemu_are_one_line_each():
    host = amd_host(ptrace_error="PTRACE_TRACEME refused", uml_tmpdir="/tmp",
                    uml_tmpdir_error="Operation not permitted", qemu={})
    assert host.problems() == [
        "UML cannot run: ptrace of a child fails (PTRACE_TRACEME refused)",
        "UML cannot run: /tmp does not allow PROT_EXEC mappings (Operation not permitted); "
        "set TMPDIR to a directory that does",
        "qemu-system-x86_64 not found: run `make deps`",
        "qemu-system-aarch64 not found: run `make deps`"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="NT_X86_XSTATE is x86's")
def test_the_ptrace_probe_measures_this_hosts_xsave_area():
    size, why = hostcheck.ptrace_xstate_bytes()
    assert why == ""
    if size is None:
        pytest.skip("this host has no XSAVE regset")
    # legacy area (512) + header (64), in 8-byte units (the regset's element)
    assert size >= 576 and size % 8 == 0


def test_uml_takes_its_memory_file_where_6_12_does(monkeypatch, tmp_path):
    for var in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TEMP", str(tmp_path))
    assert hostcheck.uml_tmpdir() == tmp_path
    assert hostcheck.exec_mapping_error(tmp_path) == ""

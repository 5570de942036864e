"""The mm selftests gate: its runner script, the parsing of a console, the gate."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from freepage_lab import harness, kernel, mmselftests, paths, selftests
from freepage_lab.context import RunContext
from freepage_lab.mmselftests import Boot, parse_boot, regressions
from freepage_lab.shell import LabError, Shell


def record(test: str, rc: int, elapsed: float = 1.0, limit: int = 300) -> str:
    return (f'{{"prog":"{mmselftests.PROG}","test":"{test}","rc":{rc},'
            f'"elapsed_s":{elapsed},"limit_s":{limit}}}')


def console(*results: tuple[str, int, list[str]]) -> list[str]:
    lines = ["FREEPAGE-BOOTED 1.0"]
    for name, rc, output in results:
        lines += [f"{mmselftests.BEGIN} {name}", *output, record(name, rc)]
    return lines


def boot_of(config: str, rnd: int, tests, lines: list[str]) -> Boot:
    records = [__import__("json").loads(ln) for ln in lines if ln.startswith('{"prog"')]
    return parse_boot(config, rnd, tests, lines, records)


def test_the_script_runs_each_test_in_order_with_run_vmtests_setup():
    tests = mmselftests.select(only=("hugetlb_fault_after_madv", "hugepage-mmap"))
    assert [t.name for t in tests] == ["hugepage-mmap", "hugetlb_fault_after_madv"]
    script = mmselftests.guest_script(tests, "echo setup")
    assert "echo 128 > /proc/sys/vm/nr_hugepages" in script
    assert script.index("echo setup") < script.index("cd /mm")
    fault = script.index("run 'hugetlb_fault_after_madv' 900 ./hugetlb_fault_after_madv")
    # one and just one huge page for it, the pool restored after
    assert script.rindex("echo 1 > /proc/sys/vm/nr_hugepages", 0, fault) > \
        script.index("run 'hugepage-mmap'")
    assert 'echo "$old_pool" > /proc/sys/vm/nr_hugepages' in script[fault:]
    assert script.count("compact_memory; sleep 2") == 2


def test_the_script_is_valid_shell_and_prints_a_record_per_test(tmp_path):
    """The runner's own code (not the tests) run by the host's sh, with
    stand-ins for the selftests: one passes, one skips, one fails."""
    tests = [mmselftests.Test("ok", "mmap"), mmselftests.Test("skip", "mmap"),
             mmselftests.Test("bad", "mmap", limit_s=5)]
    script = mmselftests.guest_script(tests)
    body = script[script.index("run() {"):]
    mm = tmp_path / "mm"
    mm.mkdir()
    for name, rc in (("ok", 0), ("skip", 4), ("bad", 1)):
        (mm / name).write_text(f"#!/bin/sh\necho output of {name}\nexit {rc}\n")
        (mm / name).chmod(0o755)
    out = subprocess.run(["sh", "-ec", f"cd {mm}\n{body}"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    boot = boot_of("stock", 0, tests, ["FREEPAGE-BOOTED 1", *out])
    assert boot.statuses == {"ok": "pass", "skip": "skip", "bad": "fail"}
    assert boot.tails["bad"] == ["output of bad"]
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 5\npgzero_marked_prezero 7\npgzero_prezero_hugetlb 3\n")
    last = script.splitlines()[-1].replace("/proc/vmstat", str(vmstat))
    out = subprocess.run(["sh", "-ec", last], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert boot_of("stock", 0, tests, out).vmstat == {"pgzero_marked_prezero": 7,
                                                      "pgzero_prezero_hugetlb": 3}


def test_status_tells_a_timeout_from_a_failure():
    assert mmselftests.status({"rc": 143, "elapsed_s": 300.2, "limit_s": 300}) == "timeout"
    assert mmselftests.status({"rc": 143, "elapsed_s": 3, "limit_s": 300}) == "fail"
    assert mmselftests.status({"rc": 4, "elapsed_s": 3, "limit_s": 300}) == "skip"


def test_a_test_without_a_record_is_lost():
    tests = mmselftests.select(only=("hugepage-mmap", "map_hugetlb"))
    lines = console(("hugepage-mmap", 0, []))
    boot = boot_of("stock", 0, tests, lines + [f"{mmselftests.BEGIN} map_hugetlb", "Oops"])
    assert boot.statuses == {"hugepage-mmap": "pass", "map_hugetlb": "lost"}
    assert boot.tails["map_hugetlb"] == ["Oops"]


# what the gate saw before the hugetlb fix: stock 3/3, pre-zeroing 1/3
MADV = "hugetlb_fault_after_madv"
FAILED = ["# [FAIL] Failed to allocated huge page", "mmap: Cannot allocate memory"]


def three_runs(prezero_rcs: list[int]) -> list[Boot]:
    tests = mmselftests.select(only=(MADV, "cow"))
    boots = []
    for rnd in range(3):
        boots.append(boot_of("stock", rnd, tests, console((MADV, 0, []), ("cow", 0, []))))
        rc = prezero_rcs[rnd]
        boots.append(boot_of("prezero", rnd, tests,
                             console((MADV, rc, FAILED if rc else []), ("cow", 0, []))))
    return boots


def test_the_gate_fails_on_a_test_that_passes_on_stock_only():
    boots = three_runs([1, 0, 1])
    tests = mmselftests.select(only=(MADV, "cow"))
    bad = regressions(boots, tests, ["stock", "prezero"])
    assert bad == [(MADV, "prezero", {"fail": 2, "pass": 1})]
    table = mmselftests.render(boots, tests, ["stock", "prezero"])
    row = next(ln for ln in table.splitlines() if ln.startswith(MADV))
    assert row.split(None, 1)[1].split("  ")[0] == "3/3" and row.rstrip().endswith("1/3 (fail 2)")
    assert regressions(three_runs([0, 0, 0]), tests, ["stock", "prezero"]) == []


def test_a_test_that_fails_on_stock_too_does_not_fail_the_gate():
    tests = mmselftests.select(only=(MADV,))
    boots = [boot_of("stock", 0, tests, console((MADV, 1, []))),
             boot_of("prezero", 0, tests, console((MADV, 1, [])))]
    assert regressions(boots, tests, ["stock", "prezero"]) == []
    assert mmselftests.cell({"skip": 3}) == "skip 3"


def test_select_names_what_was_left_out_and_why():
    with pytest.raises(LabError, match="two NUMA nodes"):
        mmselftests.select(only=("migration",))
    quick = mmselftests.select(quick=True)
    assert MADV in [t.name for t in quick] and len(quick) == len(mmselftests.QUICK)
    assert len(mmselftests.select()) == len(mmselftests.TESTS)


def test_every_test_runs_a_program_the_suite_builds():
    assert {t.program for t in mmselftests.TESTS} <= set(selftests.MM.programs)
    assert not set(mmselftests.QUICK) - {t.name for t in mmselftests.TESTS}


def test_mm_selftests_are_static_x86_builds_of_the_pristine_tree():
    argv = selftests.build_argv(selftests.MM, Path("/src"), Path("/out"))
    assert argv[:3] == ["make", "-C", "/src/tools/testing/selftests/mm"]
    assert "ARCH=x86_64" in argv and "EXTRA_CFLAGS=-static" in argv
    assert not any(a.startswith("CROSS_COMPILE") for a in argv)
    assert "/out/mm/hugetlb_fault_after_madv" in argv
    assert selftests.MM.patches == ()


def test_stock_and_series_share_the_device_and_the_fragment():
    family = harness.family("mm_selftests")
    assert {v.stock_qemu and v.balloon and v.reporting for v in family.values()} == {True}
    assert "mm-selftests.config" in kernel.STOCK_FRAGMENTS
    wanted = kernel.parse_fragment((paths.CONFIG_DIR / "mm-selftests.config").read_text())
    for opt in ("CONFIG_KSM", "CONFIG_USERFAULTFD", "CONFIG_GUP_TEST", "CONFIG_MEM_SOFT_DIRTY",
                "CONFIG_SYSVIPC"):
        assert wanted[opt] == "y", opt
    configs = mmselftests.CONFIGS
    assert configs["init_on_free"].cmdline == ("init_on_free=1",)
    assert "echo 1 > /sys/kernel/mm/prezero/hugetlb" in configs["prezero"].setup
    assert configs["reporting"].setup == "" and configs["reporting"].cmdline == ()


def test_dry_run_boots_every_configuration(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="qemu",
                     patched=True, extra_fragments=("mm-selftests.config",))
    rc, _, text = mmselftests.run(ctx, 1, mmselftests.select(quick=True),
                                  tuple(mmselftests.CONFIGS))
    assert rc == 0 and "dry run" in text
    err = capsys.readouterr().err
    guests = [ln for ln in err.splitlines() if ln.startswith("$ qemu-system-x86_64")]
    assert len(guests) == 4
    assert sum("init_on_free=1" in g for g in guests) == 1
    assert all("free-page-reporting=on" in g and "-m 3072M" in g for g in guests)
    assert "vanilla+mm-selftests" in guests[0] and "patched+mm-selftests" in guests[1]


def test_earlier_runs_join_the_table_and_the_gate(tmp_path):
    tests = mmselftests.select(only=(MADV, "cow"))
    boots = three_runs([1, 0, 1])
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    ctx = RunContext(shell=Shell(), run_dir=earlier)
    ctx.save(mmselftests.RESULT, {"tests": [t.name for t in tests],
                                  "boots": [__import__("dataclasses").asdict(b) for b in boots]})
    # no boot, so no kernel either: a dry-run shell would print any command
    again = RunContext(shell=Shell(), run_dir=tmp_path / "again", platform="uml")
    (tmp_path / "again").mkdir()
    rc, data, text = mmselftests.run(again, 0, tests, ("stock",), (earlier,))
    assert rc == 1 and data["configs"] == ["stock", "prezero"]
    assert f"REGRESSION {MADV}: passes on stock every run, prezero: 1/3 (fail 2)" in text
    # a later run that carries the earlier one: its boots count once
    rc, data, _ = mmselftests.run(RunContext(shell=Shell(), run_dir=tmp_path, platform="uml"),
                                  0, tests, ("stock",), (earlier, tmp_path / "again"))
    assert len(data["boots"]) == 6
    with pytest.raises(LabError, match="other tests"):
        mmselftests.run(again, 0, mmselftests.select(only=("cow",)), ("stock",), (earlier,))


def test_smp_boots_every_guest_with_that_many_vcpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    ctx = RunContext(shell=Shell(dry_run=True), run_dir=tmp_path, platform="qemu",
                     patched=True, extra_fragments=("mm-selftests.config",))
    mmselftests.run(ctx, 1, mmselftests.select(only=(MADV,)), ("stock", "prezero"), smp=2)
    guests = [ln for ln in capsys.readouterr().err.splitlines()
              if ln.startswith("$ qemu-system-x86_64")]
    assert len(guests) == 2 and all(" -smp 2 " in g for g in guests), guests


def test_runs_of_other_vcpu_counts_do_not_join(tmp_path):
    tests = mmselftests.select(only=(MADV,))
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    RunContext(shell=Shell(), run_dir=earlier).save(
        mmselftests.RESULT, {"tests": [t.name for t in tests], "smp": 2,
                             "boots": [__import__("dataclasses").asdict(b)
                                       for b in three_runs([0, 0, 0])]})
    again = RunContext(shell=Shell(), run_dir=tmp_path / "again", platform="uml")
    (tmp_path / "again").mkdir()
    rc, data, text = mmselftests.run(again, 0, tests, ("stock",), (earlier,), smp=2)
    assert rc == 0 and data["smp"] == 2 and "2 vCPUs" in text
    # a run from before the option booted one vCPU: it joins only a one-vCPU table
    with pytest.raises(LabError, match="guests of 2 vCPUs, not 1"):
        mmselftests.run(again, 0, tests, ("stock",), (earlier,))

"""The compile the Debian guest runs while it migrates (compilejob, the
migrate scenario's "compile" workload): Kbuild's recorded commands as a
Makefile, the guest's timing line, and the figures over the boots."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from freepage_lab import cli, compilejob, dryrun
from freepage_lab.compilejob import Job, compile_shell, makefile, parse_cmd, write_tree
from freepage_lab.runners import QemuRunner
from freepage_lab.scenarios.migrate import (
    MigrateParams,
    compile_fields,
    compile_report,
    compile_result,
    guest_script,
)
from freepage_lab.shell import LabError

DATA = Path(__file__).parent / "data"


def test_a_kbuild_cmd_file_gives_the_compile_without_objtool_and_the_files_it_read() -> None:
    job = parse_cmd((DATA / "kbuild-fadvise.o.cmd").read_text())
    assert job.obj == "mm/fadvise.o"
    assert job.command.startswith("gcc -Wp,-MMD,mm/.fadvise.o.d -nostdinc")
    assert job.command.endswith("-c -o mm/fadvise.o ../mm/fadvise.c")
    assert "objtool" not in job.command
    assert job.files[0] == "../mm/fadvise.c"
    # the dependencies, in order, the config symbols' wildcards left out
    assert job.files[1:4] == ("../include/linux/compiler-version.h",
                              "../include/linux/kconfig.h", "../include/linux/compiler_types.h")
    assert "arch/x86/include/generated/asm/rwonce.h" in job.files
    assert not [f for f in job.files if "$(" in f or not f]
    # fixdep leaves autoconf.h out; every compile reads it
    assert "include/generated/autoconf.h" in job.files


@pytest.mark.parametrize("text", ["", "cmd_foo := gcc -c foo.c\n",
                                  "savedcmd_mm/x.o := ld -r -o mm/x.o a.o\n"
                                  "source_mm/x.o := ../mm/x.c\n"])
def test_what_is_not_a_compile_command_is_refused(text) -> None:
    with pytest.raises(LabError):
        parse_cmd(text)


def jobs() -> list[Job]:
    return [Job(f"mm/{n}.o", f"touch mm/{n}.o", (f"../mm/{n}.c",)) for n in ("a", "b")]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_builds_what_it_names_and_clean_removes_it(tmp_path) -> None:
    (tmp_path / "mm").mkdir()
    (tmp_path / "Makefile").write_text(makefile(jobs()))
    subprocess.run(["make", "-s", "-j2", "-C", tmp_path], check=True)
    assert sorted(p.name for p in (tmp_path / "mm").iterdir()) == ["a.o", "b.o"]
    (tmp_path / "mm" / ".a.o.d").write_text("")
    subprocess.run(["make", "-s", "-C", tmp_path, "clean"], check=True)
    assert list((tmp_path / "mm").iterdir()) == []
    with pytest.raises(LabError):
        makefile([])


def test_the_tree_holds_what_the_compiles_read_from_both_trees(tmp_path) -> None:
    src, dest = tmp_path / "linux", tmp_path / "guest"
    obj = src / "out"
    for f in ("mm/a.c", "mm/b.c", "include/x.h", "unread.h"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text(f)
    (obj / "include/generated").mkdir(parents=True)
    (obj / "include/generated/g.h").write_text("g")
    js = [Job("mm/a.o", "cc a", ("../mm/a.c", "../include/x.h", "include/generated/g.h")),
          Job("mm/b.o", "cc b", ("../mm/b.c", "../include/x.h"))]
    write_tree(js, src, obj, dest)
    assert (dest / "include/x.h").read_text() == "include/x.h"
    assert (dest / "out/include/generated/g.h").read_text() == "g"
    assert not (dest / "unread.h").exists()
    assert (dest / "out/mm").is_dir()
    assert (dest / "out/objs").read_text() == "mm/a.o\nmm/b.o\n"
    with pytest.raises(LabError, match="outside"):
        write_tree([Job("mm/c.o", "cc c", ("/usr/include/stdio.h",))], src, obj, dest)


@pytest.mark.skipif(not Path("/usr/bin/time").exists() or shutil.which("make") is None,
                    reason="needs GNU time and make")
@pytest.mark.parametrize("fail", [False, True])
def test_the_guest_compile_prints_one_json_line_with_its_times(tmp_path, fail) -> None:
    tree = tmp_path / "out"
    (tree / "mm").mkdir(parents=True)
    js = jobs() + [Job("mm/c.o", "false" if fail else "touch mm/c.o", ())]
    (tree / "Makefile").write_text(makefile(js))
    (tree / "objs").write_text("".join(f"{j.obj}\n" for j in js))
    script = f"{compile_shell(2, str(tree), str(tmp_path))}\ncompile_run still 0\n"
    out = subprocess.run(["sh", "-e", "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "FREEPAGE-EVENT compile-start still"
    rec = json.loads(out[-1])
    assert rec["prog"] == compilejob.PROG and rec["tag"] == "still" and rec["objs"] == 3
    assert rec["jobs"] == 2 and rec["wall_s"] >= 0 and rec["user_s"] >= 0
    assert rec["rc"] == (2 if fail else 0)
    # a failed make shows its last lines; the objects are there otherwise
    assert any("Error" in ln for ln in out) == fail
    assert (tree / "mm/c.o").exists() != fail


def test_the_compile_workload_runs_both_compiles_and_the_migrated_one_in_the_background():
    script = guest_script(MigrateParams(compile_objs=7, compile_jobs=3), "compile", False)
    lines = script.splitlines()
    still, migrated, ready = (lines.index("compile_run still 7"),
                              lines.index("compile_run migrated 7 &"),
                              next(i for i, ln in enumerate(lines) if " ready " in ln))
    assert still < migrated < ready
    assert "make -s -j3" in script


def record(tag: str, t: float, wall: float, cpu: float, rc: int = 0) -> dict:
    return {"prog": "compile", "tag": tag, "objs": 12, "wall_s": wall, "user_s": cpu - 1,
            "sys_s": 1.0, "rc": rc, "_t": t}


def test_one_boots_compiles_give_host_times_their_ratio_and_whether_the_migration_was_inside():
    f = compile_fields("t", record("still", 160.0, 59.0, 100.0),
                       record("migrated", 230.0, 66.0, 110.0), still_t0=100.0,
                       migrated_t0=164.0, migrate_t0=169.0, migrate_t1=180.0)
    assert f["compile_still_host_s"] == 60.0 and f["compile_migrated_host_s"] == 66.0
    assert f["compile_still_cpu_s"] == 100.0 and f["compile_migrated_cpu_s"] == 110.0
    assert f["compile_slowdown"] == pytest.approx(1.1)
    assert f["compile_cpu_ratio"] == pytest.approx(1.1)
    assert f["migrate_into_compile_s"] == 5.0 and f["compile_covered"] is True
    # the compile ended before the migration did
    f = compile_fields("t", record("still", 160.0, 59.0, 100.0),
                       record("migrated", 230.0, 66.0, 110.0), 100.0, 164.0, 169.0, 231.0)
    assert f["compile_covered"] is False
    with pytest.raises(LabError, match="migrated compile failed"):
        compile_fields("t", record("still", 160.0, 59.0, 100.0),
                       record("migrated", 230.0, 66.0, 110.0, rc=2), 100.0, 164.0, 169.0, 180.0)


class FakeEnd:
    """A source or destination of compile_result(): its console's JSON
    lines, the host times of its console marks; a wait for a line that
    never comes times out, as Guest.wait_for() does."""

    def __init__(self, records: list[dict], marks: dict[str, float] | None = None) -> None:
        self.recs, self.marks = records, marks or {}
        self.guest, self.booted = self, self

    def records(self, prog: str) -> list[dict]:
        return [r for r in self.recs if r["prog"] == prog]

    def wait_for(self, pattern: str, timeout: float, start_index: int = 0):
        for name, t in self.marks.items():
            if name in pattern:
                return 0, SimpleNamespace(t=t), None
        if any(f'"tag":"{r["tag"]}"' in pattern for r in self.recs):
            return 0, SimpleNamespace(t=0.0), None
        raise LabError(f"timed out after {timeout} s waiting for {pattern}")


@pytest.mark.parametrize("where", ["destination", "source"])
def test_the_migrated_compiles_line_is_taken_from_the_end_that_printed_it(where) -> None:
    # a compile that ended before the switchover printed its line on the
    # source's console; the destination never prints it
    still, migrated = record("still", 160.0, 59.0, 100.0), record("migrated", 170.0, 5.0, 10.0)
    src = FakeEnd([still, *([migrated] if where == "source" else [])],
                  {"compile-start still": 100.0, "compile-start migrated": 164.0})
    dst = FakeEnd([migrated] if where == "destination" else [])
    f = compile_result("t", src, dst, 900, migrate_t0=166.0, migrate_t1=175.0)
    assert f["compile_migrated_host_s"] == 6.0
    assert f["compile_covered"] is False


def boots(migrated: list[float], still: float = 60.0) -> list[dict]:
    return [compile_fields("t", record("still", 100.0 + still, still, 100.0),
                           record("migrated", 200.0 + m, m, 100.0), 100.0, 200.0, 204.0, 210.0)
            for m in migrated]


def test_the_compile_report_gives_paired_slowdowns_and_the_variants_ratios() -> None:
    by_variant = {"no-hint": boots([66.0, 63.0, 69.0, 60.0, 72.0]),
                  "hint": boots([61.0, 60.0, 62.0, 60.0, 63.0])}
    data, rows = compile_report(["no-hint", "hint"], by_variant)
    assert data["variants"]["no-hint"]["compile_migrated_host_s"]["median"] == 66.0
    assert data["variants"]["no-hint"]["slowdown"]["ratio"] == pytest.approx(1.1)
    assert data["variants"]["hint"]["slowdown"]["ratio"] == pytest.approx(61 / 60)
    assert data["variants"]["hint"]["covered"] == 5
    ratio = data["ratios"]["hint/no-hint"]["compile_migrated_host_s"]
    assert ratio["ratio"] == pytest.approx(61 / 66)
    assert ratio["lo"] <= ratio["ratio"] <= ratio["hi"]
    assert data["ratios"]["hint/no-hint"]["compile_still_host_s"]["ratio"] == 1.0
    assert [r[0] for r in rows] == ["no-hint", "hint", "hint/no-hint"]
    # a variant without compiles (a dry run, every boot failed) has no row
    data, rows = compile_report(["no-hint", "hint"], {"no-hint": by_variant["no-hint"]})
    assert list(data["variants"]) == ["no-hint"] and not data["ratios"]


def test_the_compile_report_on_the_guests_clock_takes_the_guests_wall_time() -> None:
    # host times of a loaded host: 1.1x slower migrated; the guest's own
    # clock (-icount) says the compile's work grew by 1%
    by_variant = {v: [compile_fields("t", record("still", 160.0, 50.0, 100.0),
                                     record("migrated", 266.0, 50.5, 100.0), 100.0, 200.0,
                                     204.0, 210.0) for _ in range(5)]
                  for v in ("no-hint", "hint")}
    data, rows = compile_report(["no-hint", "hint"], by_variant, "guest")
    entry = data["variants"]["hint"]
    assert entry["compile_migrated_wall_s"]["median"] == 50.5
    assert "compile_migrated_host_s" not in entry
    assert entry["slowdown"]["ratio"] == pytest.approx(1.01)
    assert data["clock"] == "guest"
    assert rows[0][1] == "50.00 [50.00-50.00]"
    host, _ = compile_report(["no-hint", "hint"], by_variant)
    assert host["variants"]["hint"]["slowdown"]["ratio"] == pytest.approx(1.1)


def test_the_two_ends_share_one_writable_overlay_of_the_root_disk() -> None:
    args = QemuRunner.root_disk_args(Path("/r/m1-root.qcow2"), shared=True)
    assert args[1] == "file=/r/m1-root.qcow2,if=none,id=root,format=qcow2"
    assert "snapshot=on" in QemuRunner.root_disk_args(Path("/r/root.ext4"))[1]


def test_migrate_compile_dry_run_boots_both_ends_on_one_overlay(capsys) -> None:
    argv = [*dryrun.argv("migrate", "qemu-debian", ()), "--accel", "tcg", "--param",
            "workloads=compile", "--param", "variants=no-hint,hint", "--param", "rounds=1"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    overlays = [ln for ln in err.splitlines() if ln.startswith("$ qemu-img create")]
    qemu = [ln for ln in err.splitlines() if "qemu-system-x86_64" in ln and "-kernel" in ln]
    assert len(overlays) == 2 and len(qemu) == 4
    for n, overlay in enumerate(overlays):
        path = overlay.split()[-1]
        ends = qemu[2 * n:2 * n + 2]
        assert all(f"file={path},if=none,id=root,format=qcow2" in ln for ln in ends)
        assert "-incoming defer" in ends[1] and "-incoming" not in ends[0]


def test_migrate_with_icount_counts_guest_time_on_both_ends(capsys) -> None:
    argv = [*dryrun.argv("migrate", "qemu-debian", ()), "--accel", "tcg", "--param",
            "workloads=compile", "--param", "variants=hint", "--param", "rounds=1",
            "--param", "icount=true"]
    assert cli.main(argv) == 0
    qemu = [ln for ln in capsys.readouterr().err.splitlines()
            if "qemu-system-x86_64" in ln and "-kernel" in ln]
    assert len(qemu) == 2 and all(ln.endswith("-icount shift=0,sleep=off") for ln in qemu)


def test_the_compile_workload_needs_the_debian_guest(capsys) -> None:
    argv = [*dryrun.argv("migrate", "qemu", ()), "--accel", "tcg", "--param",
            "workloads=compile"]
    assert cli.main(argv) != 0
    assert "--platform qemu-debian" in capsys.readouterr().err


def test_the_compile_workload_boots_the_root_with_the_compiler(capsys, tmp_path,
                                                             monkeypatch) -> None:
    """gcc, make and the compile's tree come with the tools root, which the
    base root (file I/O alone) does without."""
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    argv = [*dryrun.argv("migrate", "qemu-debian", ()), "--accel", "tcg", "--param",
            "workloads=compile", "--param", "rounds=1"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    debstrap = [ln for ln in err.splitlines() if "mmdebstrap" in ln]
    assert len(debstrap) == 1 and "--include=gcc,make,time,qemu-system-x86" in debstrap[0]


@pytest.mark.parametrize("bad", ["smp=0", "compile_jobs=0", "compile_objs=-1",
                                 "compile_lead_s=-2"])
def test_impossible_compile_settings_are_refused_before_anything_boots(capsys, bad) -> None:
    argv = [*dryrun.argv("migrate", "qemu-debian", ()), "--accel", "tcg", "--param",
            "workloads=compile", "--param", bad]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert f"{bad.split('=')[0]} must be at least" in err and "qemu-system" not in err

"""The compile the Debian guest runs: Linux 6.12's mm/ of an x86_64 tinyconfig.

    tree = compilejob.tree(shell)     # a directory to copy into the guest's root

Made once on the host and cached by content, like the kernels: the
pristine 6.12 source (kernel.base_tree) is configured with tinyconfig and
its mm/ built by Kbuild; from each object's `.o.cmd` the lab takes
Kbuild's own compile command (objtool's check, which needs libelf, left
out) and the files the compiler read (its dependency list), and writes a
tree with only those files and a Makefile of one rule per object:

    /build/linux/            the source files the objects need
    /build/linux/out/        the configured objtree: generated headers,
                             Makefile, `objs` (the objects, one a line)

so the guest needs gcc and make alone (debroot.TOOLS_ROOT). In the guest,
`make -j2 $(head -n N objs)` compiles the first N objects; `compile_shell()`
is the guest's shell function that times one such compile with GNU time
and prints one JSON line (prog "compile").
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import buildcache, kernel, paths
from .initramfs import EVENT
from .shell import LabError, Shell

ARCH = "x86_64"
CONFIG = kernel.BASE_CONFIG  # tinyconfig
TARGET = "mm/"
# where the tree lands in the guest's root, and the objtree in it
GUEST_DIR = "/build/linux"
OBJTREE = "out"
PROG = "compile"
# bump when the tree's layout or the Makefile changes (part of the key)
LAYOUT = "1"
# what every object reads that fixdep leaves out of its dependency list
# (it stands for the config symbols, listed as $(wildcard ...) entries)
ALWAYS = ("include/generated/autoconf.h",)


@dataclass(frozen=True)
class Job:
    """One object of the compile: Kbuild's command and the files it reads
    (objtree-relative, as the .o.cmd names them: "../" for the source tree)."""

    obj: str
    command: str
    files: tuple[str, ...]


SAVED = re.compile(r"^savedcmd_(\S+) := (.*)$")
SOURCE = re.compile(r"^source_\S+ := (\S+)$")


def parse_cmd(text: str) -> Job:
    """A Kbuild `.o.cmd` file as a Job: the compile command up to the first
    " ; " (what follows is objtool's check of the object), its source, and
    its dependencies less the `$(wildcard ...)` entries (config symbols)."""
    obj = command = source = ""
    deps: list[str] = []
    in_deps = False
    for line in text.splitlines():
        if m := SAVED.match(line):
            obj, command = m.group(1), m.group(2).split(" ; ")[0].strip()
        elif m := SOURCE.match(line):
            source = m.group(1)
        elif line.startswith("deps_") and line.endswith(":= \\"):
            in_deps = True
        elif in_deps:
            entry = line.strip().removesuffix("\\").strip()
            if entry and not entry.startswith("$("):
                deps.append(entry)
            if not line.endswith("\\"):
                in_deps = False
    if not obj or not command or not source:
        raise LabError(f"not a Kbuild .o.cmd file (savedcmd_ {bool(command)}, "
                       f"source_ {bool(source)})")
    if f" -o {obj} " not in f"{command} " or " -c " not in command:
        raise LabError(f"{obj}: not a compile command: {command[:80]}")
    return Job(obj, command, tuple(dict.fromkeys([source, *deps, *ALWAYS])))


def makefile(jobs: list[Job]) -> str:
    """A Makefile of one rule per object (Kbuild's command as it saved it,
    which is already in make's quoting), `all` and `clean`."""
    if not jobs:
        raise LabError("no objects to compile")
    objs = " ".join(j.obj for j in jobs)
    lines = ["# Kbuild's compile commands of Linux 6.12 mm/ (x86_64 tinyconfig), "
             "written by the freepage lab", "pound := \\#", f"OBJS := {objs}", "",
             "all: $(OBJS)", "", "clean:", "\trm -f $(OBJS) $(foreach o,$(OBJS),"
             "$(dir $(o)).$(notdir $(o)).d)", "", ".PHONY: all clean", ""]
    for j in jobs:
        lines += [f"{j.obj}:", f"\t{j.command}", ""]
    return "\n".join(lines)


def key(version: str) -> str:
    return hashlib.sha256("\0".join([version, ARCH, CONFIG, TARGET, LAYOUT]).encode()
                          ).hexdigest()[:16]


def tree(shell: Shell) -> Path:
    """The guest's compile tree (its contents go to the root's /), made once
    per (kernel base version, config, target, layout)."""
    out = paths.cache_dir() / "debian" / f"compile-{key(kernel.base_version(shell))}"
    root = out / "root"
    product = root / GUEST_DIR.lstrip("/") / OBJTREE / "Makefile"

    def make(src: Path, dest: Path) -> bool:
        linux = dest / "linux"
        shell.run(["cp", "-al", src, linux], what="link the kernel source")
        obj = linux / OBJTREE
        for target in (CONFIG, TARGET):
            shell.run(kernel.make_argv(linux, obj, ARCH, target, jobs=2),
                      log=dest / "build.log", what=f"kbuild {target}")
        if shell.dry_run:
            return False
        jobs = [parse_cmd(p.read_text()) for p in sorted((obj / TARGET).glob(".*.o.cmd"))]
        write_tree(jobs, linux, obj, dest / "root" / GUEST_DIR.lstrip("/"))
        shutil.rmtree(linux)
        return True

    buildcache.build_once(shell, buildcache.Build("compile tree", "tree", out, product,
                                                  out.parent / f"{out.name}.lock", root),
                          lambda: kernel.base_tree(shell), make)
    return root


def write_tree(jobs: list[Job], src: Path, obj: Path, dest: Path) -> None:
    """Copy what `jobs` read from the source tree `src` and the objtree
    `obj` (its child) to `dest` and `dest`/OBJTREE; write the Makefile and
    `objs` there."""
    out = dest / OBJTREE
    for j in jobs:
        for f in j.files:
            rel = Path(f)
            if rel.is_absolute():
                raise LabError(f"{j.obj}: reads {f} outside the kernel trees")
            frm, to = (src / rel.relative_to(".."), dest / rel.relative_to("..")) \
                if f.startswith("../") else (obj / rel, out / rel)
            if not to.exists():
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(frm, to)
        (out / j.obj).parent.mkdir(parents=True, exist_ok=True)
    (out / "Makefile").write_text(makefile(jobs))
    (out / "objs").write_text("".join(f"{j.obj}\n" for j in jobs))


def compile_shell(jobs: int, where: str = f"{GUEST_DIR}/{OBJTREE}", tmp: str = "/tmp") -> str:
    """Guest shell: `compile_run TAG N` removes the objects, compiles the
    first N (0: all) with `make -j<jobs>` in `where` and prints one JSON
    line: tag, objects, GNU time's wall, user and system seconds, make's
    exit code (and make's last lines where it failed); marks its start
    ("FREEPAGE-EVENT compile-start TAG") on the console. Its files go to `tmp`."""
    fmt = (f'{{"prog":"{PROG}","tag":"%s","objs":%s,"jobs":{jobs},'
           '"wall_s":%%e,"user_s":%%U,"sys_s":%%S,"rc":%%x}')
    return "\n".join([
        "compile_run() {",
        f"\tcd {where}",
        "\tmake -s clean",
        "\tif [ \"$2\" -gt 0 ]; then objs=$(head -n \"$2\" objs); else objs=$(cat objs); fi",
        "\tn=$(echo $objs | wc -w)",
        f"\techo \"{EVENT} compile-start $1\"",
        f"\t/usr/bin/time -o {tmp}/compile-time -f \"$(printf '{fmt}' \"$1\" \"$n\")\" "
        f"make -s -j{jobs} $objs > {tmp}/compile-$1.log 2>&1 || tail -n 5 {tmp}/compile-$1.log",
        f"\tcat {tmp}/compile-time",
        "\tcd /",
        "}",
    ])

"""Debian packages of what freepage ships: guest kernel, QEMU, daemon.

    freepage package --out DIR

builds each package from the lab's cached build of the same thing and
copies the .debs into DIR:

* the guest kernel: the lab's x86_64 series kernel (`kernel.build`, the
  series' config) packaged by the kernel's own `bindeb-pkg` in a copy of
  its build tree, with the local version `-freepage`
  (`linux-image-<version>-freepage`, beside Debian's `+deb12-amd64`);
* the patched QEMU (`qemu.build`) as `qemu-system-x86-freepage`: the binary
  in /usr/lib/freepage/qemu/bin, `qemu-system-x86_64-freepage` on PATH, and
  a data directory of links to Debian's firmware, whose packages it
  depends on; Debian's `qemu-system-x86` stays as it is;
* vhost-user-balloon (`backend.binary`) with a systemd template unit and a
  man page made from its `--help`.

Each package is cached under `~/.cache/freepage/packages/<name>-<key>`,
keyed by the build it packages and by what packages it (this module and
packaging/); lintian runs once per key and an error fails the build.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import backend, buildcache, kernel, paths, qemu
from .runners import QEMU_FIRMWARE_DIRS
from .shell import LabError, Shell, StageResult, timed

PACKAGING_DIR = paths.REPO / "packaging"
MAINTAINER = "freepage <dev@freepage.invalid>"
HOMEPAGE = "https://freepage.invalid/"

# the guest kernel: its uname -r is <base>-freepage
KERNEL_LOCALVERSION = "-freepage"
KERNEL_SPEC = kernel.BuildSpec("x86_64")

QEMU_PACKAGE = "qemu-system-x86-freepage"
QEMU_PREFIX = Path("usr/lib/freepage/qemu")
QEMU_COMMAND = "qemu-system-x86_64-freepage"
# what the firmware links point into; the packages are found with dpkg -S
QEMU_FIRMWARE_PACKAGES = ("qemu-system-data", "seabios", "ipxe-qemu")

DAEMON_PACKAGE = "vhost-user-balloon"
DAEMON_UNIT = "vhost-user-balloon@.service"

WHAT = ("kernel", "qemu", "daemon")


@dataclass(frozen=True)
class Built:
    """The .debs of one package build and what lintian said of them."""

    what: str
    debs: tuple[Path, ...]
    lintian: str


# the files of packaging/ that go into each package
RECIPE_DIRS = {"kernel": (), "qemu": ("qemu",), "daemon": ("vhost-user-balloon",)}


def recipe_digest(what: str) -> str:
    """What packages a build: this module and the package's files in packaging/."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for d in RECIPE_DIRS[what]:
        for f in sorted((PACKAGING_DIR / d).rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(PACKAGING_DIR)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def package_key(what: str, *parts: str) -> str:
    h = hashlib.sha256(recipe_digest(what).encode())
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return paths.cache_dir() / "packages"


# --------------------------------------------------------------------------
# lintian
# --------------------------------------------------------------------------

def lintian_errors(output: str) -> list[str]:
    """The error lines ("E: pkg: tag ...") of lintian's output."""
    return [ln for ln in output.splitlines() if ln.startswith("E: ")]


def lintian_warnings(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("W: ")]


def run_lintian(shell: Shell, debs: list[Path], log: Path) -> str:
    """lintian on `debs`; its output is kept in `log`; an error fails."""
    argv: list[str | os.PathLike[str]] = ["lintian", "--tag-display-limit", "0", *debs]
    shell.show(argv)
    if shell.dry_run:
        return ""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False)
    out = proc.stdout
    log.write_text(out)
    errors = lintian_errors(out)
    if errors or proc.returncode not in (0, 2):
        raise LabError(f"lintian: {len(errors)} errors (exit {proc.returncode}); see {log}\n  "
                       + "\n  ".join(errors[:15] or proc.stderr.strip().splitlines()[-5:]))
    return out


def cached(shell: Shell, what: str, key: str, make: Callable[[Path], list[Path]]) -> Built:
    """The package build `what` of `key`, made once: `make(dir)` writes the
    .debs into the fresh directory and returns them; lintian must pass."""
    out = cache_root() / f"{what}-{key}"
    listing = out / "debs"

    def build(_src: Path, dest: Path) -> bool:
        debs = make(dest)
        if shell.dry_run:
            return False
        run_lintian(shell, debs, dest / "lintian.txt")
        listing.write_text("".join(d.name + "\n" for d in debs))
        return True

    buildcache.build_once(shell, buildcache.Build(f"package {what}", "package", out, listing,
                                                  cache_root() / f"{what}-{key}.lock", out),
                          lambda: out, build)
    if shell.dry_run:
        return Built(what, (), "")
    debs = tuple(out / n for n in listing.read_text().split())
    return Built(what, debs, (out / "lintian.txt").read_text())


# --------------------------------------------------------------------------
# dpkg-deb packages (QEMU, daemon)
# --------------------------------------------------------------------------

def control_text(fields: dict[str, str]) -> str:
    return "".join(f"{k}: {v}\n" for k, v in fields.items() if v)


def changelog(package: str, version: str, text: str) -> bytes:
    """A one-entry changelog.Debian, gzipped reproducibly."""
    entry = (f"{package} ({version}) unstable; urgency=medium\n\n  * {text}\n\n"
             f" -- {MAINTAINER}  Thu, 01 Jan 2026 00:00:00 +0000\n")
    return gzip.compress(entry.encode(), 9, mtime=0)


def shlib_depends(shell: Shell, binaries: list[Path]) -> str:
    """The shared-library dependencies of `binaries` (dpkg-shlibdeps)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "debian").mkdir()
        (Path(tmp) / "debian" / "control").write_text(
            "Source: freepage\n\nPackage: freepage\nArchitecture: any\n")
        out = shell.run(["dpkg-shlibdeps", "-O", *(f"-e{b}" for b in binaries)],
                        cwd=Path(tmp), capture=True, what="dpkg-shlibdeps")
    m = re.search(r"^shlibs:Depends=(.*)$", out, re.M)
    if not m and not shell.dry_run:
        raise LabError(f"dpkg-shlibdeps printed no shlibs:Depends for {binaries}")
    return m.group(1) if m else ""


def install_stripped(shell: Shell, binary: Path, dest: Path) -> None:
    if not shell.dry_run:
        dest.parent.mkdir(parents=True, exist_ok=True)
    shell.run(["strip", "--strip-unneeded", "--remove-section=.comment",
               "--remove-section=.note", "-o", dest, binary], what=f"strip {binary.name}")
    if not shell.dry_run:
        dest.chmod(0o755)


def man_page(shell: Shell, command: list[str], name: str, section: int, dest: Path,
             description: str) -> None:
    """A man page made by help2man from `command --help` / `--version`, gzipped."""
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / name
        # help2man runs `name --help`: a wrapper gives it the command line
        wrapper.write_text("#!/bin/sh\nexec " + " ".join(f"'{c}'" for c in command) + ' "$@"\n')
        wrapper.chmod(0o755)
        page = Path(tmp) / f"{name}.{section}"
        shell.run(["help2man", "--no-info", "--no-discard-stderr", f"--section={section}",
                   f"--name={description}", f"--output={page}", wrapper],
                  what=f"help2man {name}")
        if shell.dry_run:
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(gzip.compress(page.read_bytes(), 9, mtime=0))


def docs(root: Path, package: str, version: str, copyright_file: Path, note: str) -> None:
    doc = root / "usr" / "share" / "doc" / package
    doc.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(copyright_file, doc / "copyright")
    (doc / "changelog.Debian.gz").write_bytes(changelog(package, version, note))


def dpkg_deb(shell: Shell, root: Path, control: dict[str, str], out: Path,
             conffiles: tuple[str, ...] = ()) -> Path:
    """Write DEBIAN/control (with md5sums, Installed-Size) and build the .deb."""
    debian = root / "DEBIAN"
    debian.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in root.rglob("*")
                   if (p.is_file() and not p.is_symlink()) and debian not in p.parents)
    size_kib = sum(-(-p.stat().st_size // 1024) for p in files) + len(files)
    control = {**control, "Installed-Size": str(size_kib)}
    (debian / "control").write_text(control_text(control))
    (debian / "md5sums").write_text("".join(
        f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(root)}\n" for p in files))
    if conffiles:
        (debian / "conffiles").write_text("".join(f"{c}\n" for c in conffiles))
    for p in [root, *root.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    deb = out / f"{control['Package']}_{control['Version']}_{control['Architecture']}.deb"
    shell.run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", root, deb],
              what=f"dpkg-deb {control['Package']}")
    return deb


# --------------------------------------------------------------------------
# the guest kernel
# --------------------------------------------------------------------------

def kernel_version_of(build_dir: Path) -> str:
    """The base release of a kernel build (include/config/kernel.release)."""
    return (build_dir / "include" / "config" / "kernel.release").read_text().strip()


def kernel_packages(shell: Shell) -> Built:
    built = kernel.build(shell, KERNEL_SPEC)
    key = package_key("kernel", built.key)

    def make(dest: Path) -> list[Path]:
        src = built.out_dir.parent
        # a direct child of the source tree, as the build it copies (kernel.applied_tree)
        work = src / f"{built.out_dir.name}-deb-{key}"
        if work.exists() and not shell.dry_run:
            shutil.rmtree(work)
        shell.run(["cp", "-a", built.out_dir, work], what="copy the kernel build tree")
        release = "dry-run" if shell.dry_run else kernel_version_of(built.out_dir)
        version = f"{release}-1+fp.{built.key[:8]}"
        cenv = buildcache.ccache_env() or {}
        argv = kernel.make_argv(src, work, "x86_64", "bindeb-pkg", jobs=os.cpu_count() or 2,
                                ccache=bool(cenv))
        argv += [f"LOCALVERSION={KERNEL_LOCALVERSION}", f"KDEB_PKGVERSION={version}"]
        name, email = MAINTAINER.rstrip(">").split(" <")
        env = {**cenv, "DEBFULLNAME": name, "DEBEMAIL": email,
               "KDEB_CHANGELOG_DIST": "unstable", "DEB_BUILD_OPTIONS": "terse"}
        shell.run(["nice", "-n", "5", *argv], env=env, log=dest / "bindeb-pkg.log",
                  what="make bindeb-pkg")
        if shell.dry_run:
            return []
        debs = []
        # bindeb-pkg writes next to the build tree: keep the image (and the
        # headers, where the config has modules), not linux-libc-dev, which
        # would replace Debian's
        for f in sorted(src.glob(f"*_{version}_*")):
            if f.name.startswith(("linux-image-", "linux-headers-")) and f.suffix == ".deb" \
                    and "-dbg_" not in f.name:
                debs.append(Path(shutil.move(f, dest / f.name)))
            else:
                f.unlink()
        shutil.rmtree(work)
        if not debs:
            raise LabError(f"bindeb-pkg made no linux-image package; see {dest}/bindeb-pkg.log")
        return debs

    return cached(shell, "kernel", key, make)


# --------------------------------------------------------------------------
# QEMU
# --------------------------------------------------------------------------

def firmware_links(dirs: tuple[Path, ...] = QEMU_FIRMWARE_DIRS) -> dict[str, Path]:
    """name -> Debian firmware file, the first of `dirs` that has the name
    (the order -L gives them to the lab's runs)."""
    links: dict[str, Path] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted(d.iterdir()):
            if f.name not in links and (f.is_file() or f.is_dir()):
                links[f.name] = f
    return links


def qemu_package(shell: Shell) -> Built:
    built = qemu.build(shell)
    key = package_key("qemu", built.key)
    version = f"{qemu.BASE_VERSION.split('+')[0]}-1+fp.{built.key[:8]}"

    def make(dest: Path) -> list[Path]:
        root = dest / "root"
        prefix = root / QEMU_PREFIX
        binary = prefix / "bin" / qemu.BINARY_NAME
        install_stripped(shell, built.binary, binary)
        # the build's prefix is /usr/local: QEMU finds its data directory
        # relative to the binary (bin/../share/qemu), which holds links to
        # Debian's firmware
        share = prefix / "share" / "qemu"
        if not shell.dry_run:
            share.mkdir(parents=True)
            for name, target in firmware_links().items():
                (share / name).symlink_to(os.path.relpath(target, "/" + str(share.relative_to(root))))
            (root / "usr" / "bin").mkdir(parents=True)
            (root / "usr" / "bin" / QEMU_COMMAND).symlink_to(
                os.path.relpath("/" + str(QEMU_PREFIX / "bin" / qemu.BINARY_NAME), "/usr/bin"))
        man_page(shell, [str(binary)], QEMU_COMMAND, 1,
                 root / "usr" / "share" / "man" / "man1" / f"{QEMU_COMMAND}.1.gz",
                 "QEMU 10.0 x86_64 with freepage's virtio-balloon and migration series")
        depends = shlib_depends(shell, [binary])
        if shell.dry_run:
            return []
        docs(root, QEMU_PACKAGE, version, PACKAGING_DIR / "qemu" / "copyright",
             "QEMU 10.0.2 with the freepage series of qemu/ (its README lists them).")
        control = {
            "Package": QEMU_PACKAGE, "Version": version, "Architecture": "amd64",
            "Maintainer": MAINTAINER, "Section": "misc", "Priority": "optional",
            "Depends": ", ".join(filter(None, [depends, *QEMU_FIRMWARE_PACKAGES])),
            "Homepage": HOMEPAGE,
            "Description": "QEMU x86_64 emulator with freepage's virtio-balloon series\n"
            " QEMU 10.0.2 with freepage's patch series: virtio-balloon feature bits\n"
            " 6 and 7 (experimental properties x-device-init-reported and\n"
            " x-device-init-on-inflate), discards marked dirty for migration, a\n"
            " vhost-user-balloon-pci front-end, and free page hinting without a\n"
            " downtime penalty. Installed as qemu-system-x86_64-freepage, beside\n"
            " Debian's qemu-system-x86, whose firmware it uses.",
        }
        return [dpkg_deb(shell, root, control, dest)]

    return cached(shell, "qemu", key, make)


# --------------------------------------------------------------------------
# vhost-user-balloon
# --------------------------------------------------------------------------

def daemon_version() -> str:
    toml = (paths.BACKEND_DIR / "Cargo.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', toml, re.M)
    if not m:
        raise LabError(f"{paths.BACKEND_DIR}/Cargo.toml: no version")
    return m.group(1)


def daemon_package(shell: Shell) -> Built:
    exe = backend.binary(shell)
    source = backend.source_key()
    key = package_key("daemon", source)
    version = f"{daemon_version()}-1+fp.{source[:8]}"
    here = PACKAGING_DIR / "vhost-user-balloon"

    def make(dest: Path) -> list[Path]:
        root = dest / "root"
        binary = root / "usr" / "bin" / DAEMON_PACKAGE
        install_stripped(shell, exe, binary)
        man_page(shell, [str(binary)], DAEMON_PACKAGE, 8,
                 root / "usr" / "share" / "man" / "man8" / f"{DAEMON_PACKAGE}.8.gz",
                 "virtio-balloon device backend over vhost-user")
        if shell.dry_run:
            return []
        unit = root / "lib" / "systemd" / "system" / DAEMON_UNIT
        unit.parent.mkdir(parents=True)
        shutil.copyfile(here / DAEMON_UNIT, unit)
        (root / "etc" / "default").mkdir(parents=True)
        shutil.copyfile(here / "default", root / "etc" / "default" / DAEMON_PACKAGE)
        docs(root, DAEMON_PACKAGE, version, here / "copyright",
             "vhost-user-balloon from the freepage tree.")
        control = {
            "Package": DAEMON_PACKAGE, "Version": version, "Architecture": "amd64",
            "Maintainer": MAINTAINER, "Section": "misc", "Priority": "optional",
            "Depends": shlib_depends(shell, [binary]), "Homepage": HOMEPAGE,
            "Description": "virtio-balloon device backend over vhost-user\n"
            " A host daemon serving a virtio-balloon device (inflate, deflate,\n"
            " statistics, free page reporting) to a vhost-user front-end such as\n"
            " QEMU's vhost-user-balloon-pci; it gives reported and inflated\n"
            " memory back to the host by punching holes in the shared guest\n"
            " memory file. One instance per guest: vhost-user-balloon@<guest>.service.",
        }
        return [dpkg_deb(shell, root, control, dest,
                         conffiles=(f"/etc/default/{DAEMON_PACKAGE}",))]

    return cached(shell, "daemon", key, make)


BUILDERS: dict[str, Callable[[Shell], Built]] = {
    "kernel": kernel_packages, "qemu": qemu_package, "daemon": daemon_package}


def package_stage(shell: Shell, what: str, out: Path) -> StageResult:
    """Build (or take from the cache) one package and link it into `out`."""
    finish = timed(f"package {what}")
    try:
        built = BUILDERS[what](shell)
    except LabError as exc:
        return finish("failed", str(exc))
    if shell.dry_run:
        return finish("dry-run")
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for deb in built.debs:
        dest = out / deb.name
        if dest.exists():
            dest.unlink()
        shutil.copyfile(deb, dest)
        names.append(dest.name)
    warnings = lintian_warnings(built.lintian)
    detail = ", ".join(names) + f"; lintian: 0 errors, {len(warnings)} warnings"
    detail += "".join(f"\n    {w}" for w in warnings)
    return finish("ok", detail, debs=[str(out / n) for n in names])


def package_all(shell: Shell, out: Path, only: tuple[str, ...] = ()) -> list[StageResult]:
    return [package_stage(shell, what, out) for what in (only or WHAT)]

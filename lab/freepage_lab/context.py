"""What every scenario needs: a shell, a run directory, kernels, an initramfs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import compilejob, debroot, hostcheck, initramfs, kernel, paths
from . import qemu as qemu_mod
from .platforms import Platform, platform
from .runners import STOCK_QEMU, Runner, make_runner
from .shell import LabError, Shell


def new_run_dir(path: Path) -> Path:
    """Make a run's own directory: `path`, or with a suffix (-2, -3, ...)
    where a run started in the same second with the same label has it, so
    that no two runs share logs, sockets or disk overlays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise LabError(f"no free run directory next to {path}")


@dataclass
class RunContext:
    shell: Shell
    run_dir: Path
    platform: str = "qemu"
    accel: str = "auto"
    patched: bool = False
    variant: str = "release"
    extra_fragments: tuple[str, ...] = ()
    # QEMU: Debian's stock build, or one with the qemu/ series applied
    patched_qemu: bool = False
    # test-only patches (qemu/bench/) on top of the patched QEMU: a
    # baseline that takes one change back out
    qemu_extra_patches: tuple[str, ...] = ()
    # platforms with a Debian root: the root with the workloads' tools
    # (debroot.TOOLS_ROOT and the compile's tree), not the base one
    root_tools: bool = False
    # what is built once per run, shared by the contexts on() makes
    _kernels: dict[str, kernel.BuiltKernel] = field(default_factory=dict)
    _qemu: dict[str, Path] = field(default_factory=dict)
    _base_initrd: dict[str, Path] = field(default_factory=dict)
    _initrds: dict[Path, str] = field(default_factory=dict)
    _root_disk: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, shell: Shell, label: str, **kw: object) -> RunContext:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = paths.runs_dir() / f"{stamp}-{label}"
        if not shell.dry_run:
            run_dir = new_run_dir(run_dir)
            # which CPU the figures come from (`freepage host`)
            hostcheck.save(run_dir / "host.json", hostcheck.facts())
        return cls(shell=shell, run_dir=run_dir, **kw)  # type: ignore[arg-type]

    def on(self, platform_name: str, **kw: object) -> RunContext:
        """The same run (directory, builds) on another platform, or with
        other settings (patched=..., patched_qemu=...)."""
        return dataclasses.replace(self, platform=platform_name, **kw)  # type: ignore[arg-type]

    @property
    def machine(self) -> Platform:
        return platform(self.platform)

    @property
    def arch(self) -> str:
        return self.machine.arch

    def runner(self, patched_qemu: bool | None = None) -> Runner:
        binary = (self.qemu_binary(patched_qemu) if self.machine.patched_qemu
                  else STOCK_QEMU)
        return make_runner(self.platform, self.shell, self.accel, binary)

    def qemu_binary(self, patched: bool | None = None) -> Path:
        """The QEMU to run: stock, or the patched build (built once, cached)."""
        if not (self.patched_qemu if patched is None else patched):
            return STOCK_QEMU
        if "patched" not in self._qemu:
            self._qemu["patched"] = qemu_mod.build(
                self.shell, extra_patches=self.qemu_extra_patches).binary
            self._record_builds()
        return self._qemu["patched"]

    def _record_builds(self) -> None:
        """builds.json in the run directory: the build each kernel and QEMU
        of the run came from (its cache directory, named by its key), so a
        figure can be traced to the sources it ran."""
        if self.shell.dry_run:
            return
        builds = {f"kernel {label}": str(built.out_dir) for label, built in self._kernels.items()}
        builds.update({f"qemu {label}": str(binary) for label, binary in self._qemu.items()})
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "builds.json").write_text(json.dumps(builds, indent=1, sort_keys=True) + "\n")

    def kernel(self, patched: bool | None = None, extra_patches: tuple[str, ...] = (),
               series_patches: int = 0) -> Path:
        want_patched = self.patched if patched is None else patched
        fragments = (self.extra_fragments if want_patched else
                     tuple(f for f in self.extra_fragments if f in kernel.STOCK_FRAGMENTS))
        spec = kernel.BuildSpec(self.arch, self.variant, want_patched, fragments, extra_patches,
                                series_patches)
        if spec.label not in self._kernels:
            self._kernels[spec.label] = kernel.build(self.shell, spec)
            self._record_builds()
        return self._kernels[spec.label].image

    def uneven_kernels(self) -> str | None:
        """Why this run's timings of stock 6.12 against the series are not
        the series' cost, or None. Without bench.config the series' kernel
        is the lab's test kernel: the debug verifier, KUnit and CMA are on
        its side only (a fault-and-unmap loop took 1.09x of stock's guest
        time that way, 1.00-1.03x with bench.config on both)."""
        specs = [k.spec for k in self._kernels.values()]
        # the series whose fragment turns the debug verifier and KUnit on
        series = [s for s in specs
                  if s.patched and "never-zero-twice.config" in kernel.queue_for(s.arch).fragments]
        if not series or not any(not s.patched for s in specs) or any(
                "bench.config" in s.extra_fragments for s in series):
            return None
        return ("stock 6.12 was compared with the series' test kernel (debug verifier, "
                "KUnit, CMA on the series' side only): timings of one against the other "
                "are not the series' cost; for those, add --fragment bench.config")

    def initrd(self, name: str, script: str, selftests: tuple[str, ...] = ()) -> Path:
        """The arch's base initramfs plus `script` as /run.sh and the
        selftests suites named (selftests.SUITES, each under /<suite>),
        written once per (name, script, suites)."""
        if self.arch not in self._base_initrd:
            self._base_initrd[self.arch] = initramfs.base_image(self.shell, self.arch)
        dest = self.run_dir / "initrd" / f"{name}.cpio"
        key = hashlib.sha256(f"{self.arch}\0{script}\0{' '.join(selftests)}".encode()).hexdigest()
        if self._initrds.get(dest) == key:
            return dest
        extra = [e for suite in selftests for e in initramfs.selftest_entries(self.shell, suite)]
        if self.shell.dry_run:
            return dest
        initramfs.with_script(self._base_initrd[self.arch], script, dest, extra)
        self._initrds[dest] = key
        return dest

    def root_disk(self) -> Path | None:
        """The platform's root disk image (built once, cached), None without
        one: Debian's base root, or with `root_tools` the one that carries
        gcc, make, Debian's QEMU and the compile workload's tree (compilejob)."""
        if not self.machine.root:
            return None
        kind = "tools" if self.root_tools else "base"
        if kind not in self._root_disk:
            self._root_disk[kind] = (
                debroot.guest_image(self.shell, debroot.TOOLS_ROOT,
                                    trees=(compilejob.tree(self.shell),))
                if self.root_tools else debroot.guest_image(self.shell))
        return self._root_disk[kind]

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def save(self, name: str, data: dict) -> Path:
        path = self.run_dir / f"{name}.json"
        if not self.shell.dry_run:
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

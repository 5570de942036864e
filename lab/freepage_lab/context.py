"""What every scenario needs: a shell, a run directory, kernels, an initramfs."""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from . import initramfs, kernel, paths
from . import qemu as qemu_mod
from .runners import PLATFORM_ARCH, STOCK_QEMU, GuestConfig, Runner, make_runner
from .shell import Shell


@dataclass
class RunContext:
    shell: Shell
    run_dir: Path
    platform: str = "qemu"
    accel: str = "auto"
    patched: bool = False
    variant: str = "release"
    extra_fragments: tuple[str, ...] = ()
    # QEMU: Debian's stock build, or one with qemu/patches applied
    patched_qemu: bool = False
    _kernels: dict[str, kernel.BuiltKernel] = field(default_factory=dict)
    _qemu: Path | None = None
    _base_initrd: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, shell: Shell, label: str, **kw: object) -> RunContext:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = paths.runs_dir() / f"{stamp}-{label}"
        if not shell.dry_run:
            run_dir.mkdir(parents=True, exist_ok=True)
        return cls(shell=shell, run_dir=run_dir, **kw)  # type: ignore[arg-type]

    @property
    def arch(self) -> str:
        return PLATFORM_ARCH[self.platform]

    def runner(self, platform: str | None = None,
               patched_qemu: bool | None = None) -> Runner:
        platform = platform or self.platform
        binary = self.qemu_binary(patched_qemu) if platform == "qemu" else STOCK_QEMU
        return make_runner(platform, self.shell, self.accel, binary)

    def balloon_runner(self, cfg: GuestConfig, zeroing: bool | None = None) -> Runner:
        """The runner for a guest whose balloon zeroes reported and inflated
        pages and says so (bits 6 and 7, proposed), or does not.

        zeroing None: what the context stands for (freepage = the series on
        the patched QEMU). QEMU: the patched build offers the bits, Debian's
        cannot. UML: vhost-user-balloon offers them unless balloon_host()
        passed it --no-init-bits.
        """
        if zeroing is None:
            zeroing = self.patched and self.patched_qemu
        if self.platform == "uml":
            return self.runner()
        # QEMU refuses bit 6 without the reporting queue it belongs to
        cfg.device_init_reported = zeroing and cfg.free_page_reporting
        cfg.device_init_on_inflate = zeroing
        return self.runner(patched_qemu=zeroing or self.patched_qemu)

    def qemu_binary(self, patched: bool | None = None) -> Path:
        """The QEMU to run: stock, or the patched build (built once, cached)."""
        if not (self.patched_qemu if patched is None else patched):
            return STOCK_QEMU
        if self._qemu is None:
            self._qemu = qemu_mod.build(self.shell).binary
        return self._qemu

    def kernel(self, platform: str | None = None, patched: bool | None = None,
               extra_patches: tuple[str, ...] = ()) -> Path:
        arch = PLATFORM_ARCH[platform or self.platform]
        want_patched = self.patched if patched is None else patched
        fragments = (self.extra_fragments if want_patched else
                     tuple(f for f in self.extra_fragments if f in kernel.STOCK_FRAGMENTS))
        spec = kernel.BuildSpec(arch, self.variant, want_patched, fragments, extra_patches)
        if spec.label not in self._kernels:
            self._kernels[spec.label] = kernel.build(self.shell, spec)
        return self._kernels[spec.label].image

    def initrd(self, name: str, script: str) -> Path:
        if self.arch not in self._base_initrd:
            self._base_initrd[self.arch] = initramfs.base_image(self.shell, self.arch)
        dest = self.run_dir / "initrd" / f"{name}.cpio"
        if self.shell.dry_run:
            return dest
        return initramfs.with_script(self._base_initrd[self.arch], script, dest)

    def balloon_host(self, cfg: GuestConfig, name: str,
                     extra: tuple[str, ...] = ()) -> AbstractContextManager[object]:
        """The balloon's host side: vhost-user-balloon for UML; QEMU brings its own.

        Sets the guest's vhost-user socket; enter it around the guest's life.
        """
        if self.platform != "uml":
            return nullcontext()
        from .backend import BalloonBackend

        backend = BalloonBackend(self.shell, self.run_dir / f"{name}.sock",
                                 self.log(f"{name}-backend"), list(extra))
        cfg.vhost_user_balloon = backend.socket
        return backend

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def save(self, name: str, data: dict) -> Path:
        path = self.run_dir / f"{name}.json"
        if not self.shell.dry_run:
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

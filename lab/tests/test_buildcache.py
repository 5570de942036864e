import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from freepage_lab import buildcache
from freepage_lab.shell import Shell


def cached(tmp_path: Path) -> buildcache.Build:
    out = tmp_path / "src" / "build-1"
    return buildcache.Build("thing", "thing", out, out / "product", tmp_path / "locks" / "1.lock", out)


def test_a_build_is_made_once_and_then_served_from_the_cache(tmp_path, capsys):
    build = cached(tmp_path)
    calls = []

    def make(src: Path, out: Path) -> bool:
        calls.append((src, out))
        (out / "product").write_text("built")
        return True

    buildcache.build_once(Shell(), build, lambda: tmp_path / "src", make)
    buildcache.build_once(Shell(), build, lambda: tmp_path / "src", make)
    assert calls == [(tmp_path / "src", build.out)]
    assert build.done()
    out = capsys.readouterr().out
    assert "build thing: done in" in out and "build thing: cached" in out


def test_a_failed_build_is_made_again_from_an_empty_directory(tmp_path):
    build = cached(tmp_path)

    def fail(src: Path, out: Path) -> bool:
        (out / "half").write_text("")
        raise RuntimeError("compiler crashed")

    try:
        buildcache.build_once(Shell(), build, lambda: tmp_path / "src", fail)
    except RuntimeError:
        pass
    assert not build.done()
    seen = []
    buildcache.build_once(Shell(), build, lambda: tmp_path / "src",
                          lambda src, out: seen.append(sorted(out.iterdir())) or True)
    assert seen == [[]]


def test_a_dry_run_makes_nothing(tmp_path):
    build = cached(tmp_path)
    buildcache.build_once(Shell(dry_run=True), build, lambda: tmp_path / "src", lambda s, o: False)
    assert not build.out.exists() and not build.lock.exists()


def test_the_patch_queue_does_not_import_the_kernel_module():
    source = Path(buildcache.__file__).with_name("patchqueue.py").read_text()
    imported = {a.name for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) for a in node.names}
    assert "kernel" not in imported and "qemu" not in imported


def test_the_kernel_names_stay_importable():
    from freepage_lab import kernel, patchqueue, prefixbuild
    assert kernel.Series.stacked and kernel.QUEUES and kernel.stack and prefixbuild.build_each
    assert issubclass(kernel.Series, patchqueue.Series)


def _compile_twice(tmp_path: Path, monkeypatch, source_name: str, text: str) -> list[bytes]:
    """Compile `text` twice through the lab's cached compiler, with the file
    it embeds changed in between; the two objects' .rodata."""
    if shutil.which("ccache") is None:
        pytest.skip("ccache is not installed (make test installs it)")
    monkeypatch.setattr(buildcache.paths, "cache_dir", lambda: tmp_path / "cache")
    env = {**os.environ, **(buildcache.ccache_env() or {})}
    (tmp_path / source_name).write_text(text)
    got = []
    for data in (b"first image\n", b"other image\n"):
        (tmp_path / "image.bin").write_bytes(data)
        argv = [*buildcache.cached_compiler("gcc").split(), "-Wp,-MMD,obj.d", "-c", f"./{source_name}",
                "-o", "obj.o"]
        subprocess.run(argv, cwd=tmp_path, env=env, check=True)
        subprocess.run(["objcopy", "-O", "binary", "-j", ".rodata", "obj.o", "rodata.bin"],
                       cwd=tmp_path, env=env, check=True)
        got.append((tmp_path / "rodata.bin").read_bytes())
    return got


def test_an_assembler_incbin_is_not_served_from_the_cache(tmp_path, monkeypatch):
    """x86's compressed kernel is an .incbin of piggy.S. Through ccache in
    depend mode (which keys a compile on the files the compiler's
    dependency output lists, and .incbin is not one) a bzImage came back
    with the kernel of an earlier build of the same sizes: the lab booted
    the kernel of another series version than the one it had built."""
    got = _compile_twice(tmp_path, monkeypatch, "piggy.S",
                         '.section .rodata\n.incbin "image.bin"\n')
    assert got == [b"first image\n", b"other image\n"]


def test_the_kernel_configuration_blob_is_not_served_from_the_cache(tmp_path, monkeypatch):
    """kernel/configs.c embeds the configuration with an inline .incbin."""
    (tmp_path / "kernel").mkdir()
    got = _compile_twice(tmp_path, monkeypatch, "kernel/configs.c",
                         'asm(".section .rodata\\n.incbin \\"image.bin\\"\\n.previous");\n')
    assert got == [b"first image\n", b"other image\n"]


def test_c_is_still_served_from_the_cache_when_unchanged(tmp_path, monkeypatch):
    got = _compile_twice(tmp_path, monkeypatch, "unit.c", 'const char s[] = "c source";\n')
    assert got[0] == got[1] and b"c source" in got[0]
    stats = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True,
                           env={**os.environ, **(buildcache.ccache_env() or {})}).stdout
    hits = {k: int(v) for k, v in (ln.split("\t") for ln in stats.splitlines() if "\t" in ln)}
    assert hits.get("direct_cache_hit", 0) == 1, stats

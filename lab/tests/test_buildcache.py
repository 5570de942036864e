import ast
from pathlib import Path

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

from pathlib import Path

import pytest

from freepage_lab import kernel, paths
from freepage_lab.shell import LabError


def test_parse_fragment_reads_values_and_not_set():
    text = "CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=n\nCONFIG_D=\"x\"\n# comment\n"
    assert kernel.parse_fragment(text) == {
        "CONFIG_A": "y", "CONFIG_B": "n", "CONFIG_C": "n", "CONFIG_D": '"x"'}


def test_config_mismatches_names_dropped_options():
    wanted = {"CONFIG_A": "y", "CONFIG_B": "n", "CONFIG_C": "y"}
    final = {"CONFIG_A": "y", "CONFIG_C": "m"}
    assert kernel.config_mismatches(wanted, final) == ["CONFIG_C: wanted y, got m"]


def test_make_argv_uses_out_of_tree_build():
    argv = kernel.make_argv(Path("/src"), Path("/out"), "um", "olddefconfig", jobs=2)
    assert argv == ["make", "-C", "/src", "O=/out", "ARCH=um", "-j2", "olddefconfig"]


def test_image_path_per_arch():
    assert kernel.image_path(Path("/o"), "um") == Path("/o/linux")
    assert kernel.image_path(Path("/o"), "x86_64") == Path("/o/arch/x86/boot/bzImage")


def test_build_key_depends_on_series_variant_and_version(tmp_path):
    (tmp_path / "a.patch").write_text("one")
    series = kernel.Series(tmp_path, ("a.patch",))
    spec = kernel.BuildSpec("um")
    k1 = kernel.build_key(spec, "6.12.1", series)
    assert k1 == kernel.build_key(spec, "6.12.1", series)
    assert k1 != kernel.build_key(spec, "6.12.2", series)
    assert k1 != kernel.build_key(kernel.BuildSpec("um", "debug"), "6.12.1", series)
    (tmp_path / "a.patch").write_text("two")
    assert k1 != kernel.build_key(spec, "6.12.1", series)
    vanilla = kernel.BuildSpec("um", patched=False)
    assert kernel.build_key(vanilla, "6.12.1", series) != k1


def test_series_load_rejects_missing_patch(tmp_path):
    (tmp_path / "series").write_text("# comment\n0001-x.patch\n")
    with pytest.raises(LabError, match="0001-x.patch"):
        kernel.Series.load(tmp_path)


def test_series_load_skips_comments(tmp_path):
    (tmp_path / "0001-x.patch").write_text("p")
    (tmp_path / "series").write_text("# head\n\n0001-x.patch  # first\n")
    assert kernel.Series.load(tmp_path).names == ("0001-x.patch",)


def test_buildspec_rejects_unknown_arch():
    with pytest.raises(LabError, match="unknown arch"):
        kernel.BuildSpec("riscv")


def test_every_shipped_fragment_parses():
    for frag in paths.CONFIG_DIR.glob("*.config"):
        assert kernel.parse_fragment(frag.read_text()), frag


def test_stock_kernel_with_test_only_patches_is_keyed_by_them(tmp_path):
    vanilla = kernel.BuildSpec("um", patched=False)
    plain = kernel.build_key(vanilla, "6.12.1", kernel.Series.empty())
    (tmp_path / "bench.patch").write_text("one")
    extra = kernel.Series(tmp_path, ("bench.patch",))
    with_bench = kernel.build_key(vanilla, "6.12.1", extra)
    assert with_bench != plain
    (tmp_path / "bench.patch").write_text("two")
    assert kernel.build_key(vanilla, "6.12.1", extra) != with_bench


def test_builds_are_direct_children_of_their_source_tree(tmp_path, monkeypatch, capsys):
    """kbuild then names sources "../mm/x.c": ccache hits across series edits."""
    from freepage_lab.shell import Shell

    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path))
    (tmp_path / "a.patch").write_text("one")
    series = kernel.Series(tmp_path, ("a.patch",))
    shell = Shell(dry_run=True)
    built = kernel.build(shell, kernel.BuildSpec("x86_64"), series)
    tree = kernel.tree_path(shell, series)
    assert built.out_dir.parent == tree and tree.parent == tmp_path / "src"
    out = capsys.readouterr().err
    assert f"make -C {tree} O={built.out_dir} ARCH=x86_64" in out
    # the stock kernel gets a tree of its own: the pristine base stays clean
    stock = kernel.build(shell, kernel.BuildSpec("x86_64", patched=False))
    assert stock.out_dir.parent == kernel.tree_path(shell, kernel.Series.empty()) != tree
    (tmp_path / "a.patch").write_text("two")
    assert kernel.tree_path(shell, series) != tree


def test_uml_kernels_stock_and_series_carry_the_platform_patches_first(tmp_path, monkeypatch,
                                                                       capsys):
    """A UML comparison stays like for like: both sides boot on AMX hosts."""
    from freepage_lab.shell import Shell

    platform = kernel.Series.load(kernel.PLATFORM_QUEUES["um"].patch_dir).files
    assert platform, "kernel/platform/um/patches/series lists no patch"
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path))
    shell = Shell(dry_run=True)
    for patched in (False, True):
        capsys.readouterr()
        kernel.build(shell, kernel.BuildSpec("um", patched=patched))
        applied = [ln.rsplit(" -i ", 1)[1] for ln in capsys.readouterr().err.splitlines()
                   if ln.startswith("$ patch -p1") and " -i " in ln]
        assert applied[:len(platform)] == [str(f) for f in platform], applied
        assert (len(applied) > len(platform)) == patched
    # the other arches carry none
    capsys.readouterr()
    kernel.build(shell, kernel.BuildSpec("x86_64", patched=False))
    assert "platform" not in capsys.readouterr().err

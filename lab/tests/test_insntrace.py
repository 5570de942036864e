import pytest

from freepage_lab import cli, insntrace
from freepage_lab.shell import LabError

NM = """\
ffffffff81000000 T _text
ffffffff81000100 t alloc_a
ffffffff81000200 T __free_pages
ffffffff81000300 d some_data
ffffffff81000400 t loop
"""


def syms():
    return insntrace.Symbols.parse(NM)


def test_symbols_take_text_only_and_name_addresses():
    s = syms()
    assert s.names == ["_text", "alloc_a", "__free_pages", "loop"]
    assert s.name(0xffffffff81000104) == "alloc_a"
    assert s.name(0xffffffff81000200) == "__free_pages"
    assert s.address("loop") == 0xffffffff81000400
    with pytest.raises(LabError, match="no symbol nope"):
        s.address("nope")


def iteration(free_steps=2, alloc_steps=3):
    free = [0xffffffff81000200 + i for i in range(free_steps)]
    loop = [0xffffffff81000400]
    alloc = [0xffffffff81000100 + i for i in range(alloc_steps)]
    return free + loop + alloc + loop


def test_one_iteration_counts_per_function_in_order():
    pcs = [0xffffffff81000410] + iteration() * 3
    it = insntrace.one_iteration(pcs, syms())
    assert it.total == 7
    assert it.functions == {"__free_pages": 2, "loop": 2, "alloc_a": 3}


def test_the_most_common_iteration_length_is_the_steady_state():
    pcs = iteration(alloc_steps=5) + iteration() + iteration() + iteration()
    it = insntrace.one_iteration(pcs, syms())
    assert it.total == 7 and it.functions["alloc_a"] == 3
    assert it.lengths == [9, 7, 7]


def test_no_two_iterations_alike_is_not_a_steady_state():
    pcs = iteration() + iteration(alloc_steps=5) + iteration(alloc_steps=6) + iteration()
    with pytest.raises(LabError, match="no two iterations alike"):
        insntrace.one_iteration(pcs, syms())


def test_too_short_a_trace_says_so():
    with pytest.raises(LabError, match="entered 2 times"):
        insntrace.one_iteration(iteration() * 2, syms())


def test_table_shows_the_difference_to_the_first_kernel():
    a = insntrace.Iteration(7, {"__free_pages": 2, "alloc_a": 5})
    b = insntrace.Iteration(9, {"__free_pages": 2, "alloc_a": 6, "helper": 1})
    out = insntrace.table({"stock": a, "series": b})
    assert out.splitlines()[0].split() == ["function", "stock", "series", "diff"]
    assert "helper" in out and out.splitlines()[-1].split() == ["total", "7", "9", "+2"]


def test_trace_dry_run_prints_qemu_and_gdb(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    assert cli.main(["--dry-run", "trace"]) == 0
    err = capsys.readouterr().err
    assert "-gdb tcp:127.0.0.1:" in err and "$ gdb -q -batch" in err
    assert "page-zeroed-bench.patch" in err
    assert not (tmp_path / "runs").exists()

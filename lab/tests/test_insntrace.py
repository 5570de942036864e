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


# -- the fault loop, counted per translation block ------------------------------

BLOCKS = """\
ffffffff81000100 10 3
ffffffff81000180 4 2
ffffffff81000200 5 1
401000 7 100
"""


def test_blocks_go_to_the_function_they_start_in_and_user_space_apart():
    blocks = insntrace.parse_blocks(BLOCKS)
    assert blocks[0] == (0xffffffff81000100, 10, 3)
    assert insntrace.per_function(blocks, syms()) == {
        "alloc_a": 10 * 3 + 4 * 2, "__free_pages": 5, insntrace.USER: 700}


def test_a_garbled_count_line_is_named():
    with pytest.raises(LabError, match="line 2: 'ffff zz'"):
        insntrace.parse_blocks("ffffffff81000100 10 3\nffff zz\n")


def test_per_fault_is_the_long_loop_minus_the_short_one():
    short = insntrace.per_function(insntrace.parse_blocks(BLOCKS), syms())
    long = insntrace.per_function(insntrace.parse_blocks(
        "ffffffff81000100 10 13\nffffffff81000200 5 1\n401000 7 300\n"), syms())
    res = insntrace.per_fault(short, long, faults=10)
    assert res == {"alloc_a": (130 - 38) / 10, "__free_pages": 0.0, insntrace.USER: 140.0}
    with pytest.raises(LabError, match="0 more faults"):
        insntrace.per_fault(short, long, faults=0)


def test_the_churn_record_gives_the_faults():
    console = ('[   33.6] {"prog":"churn","tag":"churn","iterations":2,"total_faults":262144}\n'
               "FREEPAGE-EXIT 0\n")
    assert insntrace.churn_faults(console) == 262144
    with pytest.raises(LabError, match="no churn record"):
        insntrace.churn_faults("FREEPAGE-EXIT 0\n")


def test_fault_table_puts_the_largest_difference_first():
    table = insntrace.fault_table({"stock": {"a": 10.0, "b": 5.0},
                                   "series": {"a": 10.5, "b": 8.0}}).splitlines()
    assert table[1].split() == ["b", "5.0", "8.0", "+3.0"]
    assert table[-1].split() == ["total", "15.0", "18.5", "+3.5"]


def test_fault_trace_dry_run_builds_the_plugin_and_boots_each_kernel_twice(
        capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    assert cli.main(["--dry-run", "trace", "--loop", "fault"]) == 0
    err = capsys.readouterr().err
    assert "lab/qemu-plugin/blockcount.c" in err and "$ gcc -shared" in err
    boots = [line for line in err.splitlines() if line.startswith("$ qemu-system-x86_64")]
    assert len(boots) == 4 and all("libblockcount.so,out=" in b and "nokaslr" in b
                                   and "-icount shift=0" in b for b in boots)
    assert "page-zeroed-bench.patch" not in err


def test_fault_trace_with_a_bench_patch_boots_a_third_kernel_that_has_it(
        capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREEPAGE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("FREEPAGE_CACHE", str(tmp_path / "cache"))
    assert cli.main(["--dry-run", "trace", "--loop", "fault", "--patch", "pcp-drop.patch"]) == 0
    err = capsys.readouterr().err
    boots = [line for line in err.splitlines() if line.startswith("$ qemu-system-x86_64")]
    assert len(boots) == 6
    assert "pcp-drop.patch" in err and "+pcp-drop" in boots[-1] and "+pcp-drop" not in boots[0]


def test_tables_widen_their_columns_for_long_labels():
    it = insntrace.Iteration(7, {"f": 7})
    rows = insntrace.table({"stock": it, "series+pcp-list": it}).splitlines()
    assert rows[0].split() == ["function", "stock", "series+pcp-list", "diff"]
    assert len({len(r) for r in rows}) == 1, rows
    rows = insntrace.fault_table({"stock": {"f": 1.0}, "series+pcp-drop": {"f": 2.0}}).splitlines()
    assert len({len(r) for r in rows}) == 1, rows

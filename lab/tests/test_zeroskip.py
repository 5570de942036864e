"""The zeroskip scenario's guest script."""

from freepage_lab.scenarios import zeroskip


def test_gigantic_pages_get_a_pool_per_populate_counted_where_they_are_allocated():
    """Gigantic pages have no surplus: the script sizes the 1 GiB pool around
    each populate. The measured pool is allocated between the two vmstat
    reads, since that allocation is where a gigantic page learns it is zero;
    the warm pool goes back to the buddy allocator before the report."""
    p = zeroskip.ZeroskipParams(populate_mib=2048, repeat=1)
    lines = zeroskip.guest_script(p, ("hugetlb-1g",)).splitlines()
    assert any(t.startswith("gigantic_pool() {") for t in lines)
    warm = next(i for i, t in enumerate(lines) if "--tag warm" in t)
    flush = next(i for i, t in enumerate(lines) if "page_reporting/flush" in t)
    before = next(i for i, t in enumerate(lines) if t.endswith("> /tmp/v0 || true"))
    measure = next(i for i, t in enumerate(lines) if "--tag measure" in t)
    after = next(i for i, t in enumerate(lines) if t.endswith("> /tmp/v1 || true"))
    assert lines[warm - 1] == "gigantic_pool 2"
    assert lines[warm + 1] == "gigantic_pool 0" and warm + 1 < flush
    assert before < measure - 1 and lines[measure - 1] == "gigantic_pool 2"
    assert lines[after + 1] == "gigantic_pool 0"


def test_other_modes_leave_the_gigantic_pool_alone():
    script = zeroskip.guest_script(zeroskip.ZeroskipParams(repeat=1), ("4k", "thp", "hugetlb"))
    assert "gigantic_pool" not in script

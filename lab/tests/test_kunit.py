from pathlib import Path

from freepage_lab import kunit

DATA = Path(__file__).parent / "data"


def test_recorded_console_suites_and_failures():
    res = kunit.parse((DATA / "kunit-console.log").read_text().splitlines())
    assert res.suites["example_zeroed"] == {"pass": 2, "fail": 0, "skip": 1, "total": 3}
    assert res.suites["example_other"]["fail"] == 1
    assert res.failed == ["test_b", "example_other"]
    assert res.passed == 3 and not res.ok
    assert res.skipped == {"test_needs_thp": "no THP on UML"}


def test_no_suites_is_not_ok():
    assert not kunit.parse(["booting", "FREEPAGE-EXIT 0"]).ok

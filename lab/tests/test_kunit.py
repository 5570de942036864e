from pathlib import Path

import pytest

from freepage_lab import kunit, prefixbuild
from freepage_lab.shell import LabError, Shell

DATA = Path(__file__).parent / "data"


def test_recorded_console_suites_and_failures():
    res = kunit.parse((DATA / "kunit-console.log").read_text().splitlines())
    assert res.suites["example_zeroed"] == {"pass": 2, "fail": 0, "skip": 1, "total": 3}
    assert res.suites["example_other"]["fail"] == 1
    assert res.failed == ["test_b", "example_other"]
    assert res.passed == 3 and not res.ok
    assert res.skipped == {"test_needs_thp": "no THP on UML"}
    # what the failed case said, and nothing for the suite that only summed it up
    assert res.diagnostics == {"test_b": [
        "# test_b: EXPECTATION FAILED at mm/tests/example.h:12",
        "Expected kept to be true, but is false"]}


def test_no_suites_is_not_ok():
    assert not kunit.parse(["booting", "FREEPAGE-EXIT 0"]).ok


def test_a_failed_prefix_says_what_the_case_printed(tmp_path):
    """build-each's KUnit step names the failed case and what it printed,
    not only where the log is."""
    linux = tmp_path / "linux"
    linux.write_text(f"#!/bin/sh\ncat {DATA / 'kunit-console.log'}\n")
    linux.chmod(0o755)
    with pytest.raises(LabError) as err:
        prefixbuild.run_kunit(Shell(), tmp_path, "0003 mm/example")
    assert "KUnit failed: test_b, example_other" in str(err.value)
    assert ("test_b: # test_b: EXPECTATION FAILED at mm/tests/example.h:12"
            " / Expected kept to be true, but is false") in str(err.value)

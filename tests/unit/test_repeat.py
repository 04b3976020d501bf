"""tests/repeat.py: per-test outcome counts over rounds, from pytest's JUnit reports."""

import pytest
from repeat import failure_lines, parse_junit, tally

pytestmark = pytest.mark.unit

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.faults.t" name="test_ok" time="1"/>
<testcase classname="tests.faults.t" name="test_bad" time="1"><failure message="x"/></testcase>
<testcase classname="tests.faults.t" name="test_err" time="1"><error message="y"/></testcase>
<testcase classname="tests.faults.t" name="test_skip" time="0"><skipped message="z"/></testcase>
<testcase classname="" name="" time="0"><error message="KeyboardInterrupt"/></testcase>
</testsuite></testsuites>"""


def test_each_outcome_is_read_and_a_skip_is_not_a_pass(tmp_path):
    p = tmp_path / "r.xml"
    p.write_text(JUNIT)
    got = parse_junit(p)
    assert got == {
        "tests.faults.t::test_ok": "passed",
        "tests.faults.t::test_bad": "failed",
        "tests.faults.t::test_err": "error",
        "tests.faults.t::test_skip": "skipped",
    }
    assert parse_junit(tmp_path / "absent.xml") == {}  # a round that wrote no report


def test_counts_over_rounds_name_a_test_missing_from_a_round():
    counts = tally([{"a": "passed", "b": "failed"}, {"a": "passed"}, {"a": "error", "b": "passed"}])
    assert counts["a"] == {"passed": 2, "failed": 0, "error": 1, "skipped": 0, "missing": 0}
    assert counts["b"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0, "missing": 1}


def test_the_first_line_of_each_red_test_is_kept(tmp_path):
    p = tmp_path / "r.xml"
    p.write_text(JUNIT.replace('message="x"', 'message="AssertionError: one&#10;two"'))
    assert failure_lines(p) == {
        "tests.faults.t::test_bad": "AssertionError: one",
        "tests.faults.t::test_err": "y",
    }
    assert failure_lines(tmp_path / "absent.xml") == {}

"""``bench/misses.py`` (issue 33): the counts it reads from cachegrind's summary, the
per-decision difference between its two runs, the child run it puts under valgrind,
and its refusal without valgrind. Valgrind itself is not run here (a minute per child);
the child is run plainly, the same code valgrind watches."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench" / "misses.py"
_spec = importlib.util.spec_from_file_location("bench_misses", BENCH)
misses = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(misses)

SUMMARY = """==4242== Cachegrind, a cache and branch-prediction profiler
==4242== I   refs:      4,941,969,530
==4242== I1  misses:        9,544,140
==4242== D   refs:      2,304,449,906  (1,600,000,000 rd   + 704,449,906 wr)
==4242== D1  misses:        6,595,841  (  5,000,000 rd   +   1,595,841 wr)
==4242== LLd misses:          174,570  (    103,560 rd   +      71,010 wr)
"""


def test_the_summary_totals_are_read_and_the_other_lines_ignored():
    assert misses.parse_counts(SUMMARY) == {
        "instructions": 4_941_969_530,
        "data_refs": 2_304_449_906,
        "misses": 6_595_841,
    }


def test_a_summary_without_the_cache_lines_is_named_not_read_as_zero():
    no_sim = "\n".join(x for x in SUMMARY.splitlines() if "D1" not in x)
    with pytest.raises(ValueError, match="no misses"):
        misses.parse_counts(no_sim)
    with pytest.raises(ValueError, match="no instructions, data_refs, misses"):
        misses.parse_counts("Traceback (most recent call last):\n")


def test_per_decision_is_the_difference_over_the_decisions_between():
    short = {
        "instructions": 100,
        "data_refs": 40,
        "misses": 10,
        "decisions": 2_000,
        "events": 3_000,
    }
    long = {
        "instructions": 1_100,
        "data_refs": 90,
        "misses": 60,
        "decisions": 2_500,
        "events": 3_750,
    }
    assert misses.per_decision(short, long) == {
        "instructions": 2.0,
        "data_refs": 0.1,
        "misses": 0.1,
        "events": 1.5,
    }
    with pytest.raises(ValueError, match="no more decisions"):
        misses.per_decision(long, short)


def test_the_child_runs_the_saturated_workload_and_reports_its_decisions():
    p = subprocess.run(
        [sys.executable, str(BENCH), "--child", "round_robin", "small", "300"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["decisions"] >= 300 and report["events"] > report["decisions"]


def test_without_valgrind_it_says_what_to_install_and_runs_nothing(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty folder: no valgrind on it
    p = subprocess.run(
        [sys.executable, str(BENCH), "--json", str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2
    assert "apt-get install valgrind" in p.stderr
    assert not (tmp_path / "out.json").exists()

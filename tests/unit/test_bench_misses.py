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
        [sys.executable, str(BENCH), "--child", "round_robin", "small", "oldest", "300"],
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


def test_the_child_refuses_an_order_or_pool_it_does_not_know():
    for args in (
        ["round_robin", "small", "newst", "300"],
        ["round_robin", "tiny", "oldest", "300"],
    ):
        p = subprocess.run(
            [sys.executable, str(BENCH), "--child", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2 and "order must be one of oldest, newest" in p.stderr, p
        assert p.stdout == ""


def test_the_rows_and_summary_come_from_each_case_s_two_runs(tmp_path, monkeypatch):
    """main() over scripted counts (valgrind's part replaced: a run's counts are its
    decisions times a figure per case, plus a start-up cost both runs share)."""
    per = {("small", "oldest"): 6, ("xl", "oldest"): 50, ("xl", "newest"): 20}

    def counts(policy: str, pool: str, order: str, decisions: int) -> dict[str, int]:
        k = per[(pool, order)] + (2 if policy == "affinity" else 0)
        return {
            "instructions": 1_000_000 + decisions * 1_000 * k,
            "data_refs": 500_000 + decisions * 400,
            "misses": 7_000 + decisions * k,
            "decisions": decisions + 3,
            "events": 3 * decisions // 2,
        }

    monkeypatch.setattr(misses, "counted", counts)
    monkeypatch.setattr(misses.shutil, "which", lambda name: "/usr/bin/" + name)
    out = tmp_path / "misses.json"
    assert misses.main(["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["policy"], r["pool"], r["order"]): r for r in doc["rows"]}
    assert len(rows) == 9 and all(r["decisions"] == 10_000 for r in rows.values())
    assert rows[("affinity", "xl", "oldest")]["misses"] == 52.0
    assert rows[("round_robin", "xl", "newest")]["instructions"] == 20_000.0
    assert rows[("least_loaded", "small", "oldest")]["events"] == 1.5
    s = doc["summary"]
    assert s["misses_per_decision_xl_newest_first_round_robin"] == 20.0
    assert s["misses_per_decision_largest_minus_smallest_max"] == 44.0
    assert s["instructions_ratio_largest_to_smallest_max"] == round(50 / 6, 3)
    assert "| affinity | xl (256/3072/768) | newest |" in doc["markdown"]

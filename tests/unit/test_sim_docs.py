"""The evaluation page and the README say what the committed full simulator run says:
its verdict sentence and its per-verdict lines are copied from
``docs/results/sim.json``'s summary, and this test fails when they differ."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def committed_summary():
    return json.loads((ROOT / "docs" / "results" / "sim.json").read_text())["summary"]


def test_committed_sim_run_is_a_full_run():
    s = committed_summary()
    assert s["smoke_run"] is False and s["verdicts_from_full"] is False
    assert s["seeds"]["judging"] >= 8
    assert s["same_scheduler"] is True
    assert sum(s["verdicts"].values()) == len(s["capacity_ratio"]) == len(s["best_split"])


def test_evaluation_and_readme_match_the_committed_run():
    s = committed_summary()
    evaluation = (ROOT / "docs" / "evaluation.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert s["verdict_sentence"] in evaluation
    assert s["verdict_sentence"] in readme
    for line in s["verdict_lines"]:
        assert line in evaluation

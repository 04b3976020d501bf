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


def test_committed_run_carries_flex_and_elastic_verdicts():
    """Issue 30: flex and elastic against colocated (same scheduler, same memory rule)
    and elastic against the best static split on every workload, the shifting and
    bursty ones included, each ratio with its interval."""
    s = committed_summary()
    cells = set(s["capacity_ratio"])
    for key in ("flex_verdicts", "elastic_verdicts"):
        assert set(s[key]) == {"win", "tie", "lose"}
        assert sum(s[key].values()) == len(cells)
    assert set(s["flex_ratio"]) == set(s["elastic_ratio"]) == cells
    vs = s["elastic_vs_best_static"]
    assert cells <= set(vs)
    assert any(k.startswith("shifting") for k in vs) and any("bursty" in k for k in vs)
    for e in vs.values():
        assert isinstance(e["ratio"], float) and isinstance(e["ci95"], float)
        assert e["verdict"] in ("win", "tie", "lose")
    assert s["planner"] in ("reactive", "predictive") and "swap" in s["memory_rule"]


def test_evaluation_has_the_flex_and_elastic_lines_of_the_committed_run():
    s = committed_summary()
    evaluation = (ROOT / "docs" / "evaluation.md").read_text()
    assert s["elastic_sentence"] in evaluation
    assert s["elastic_sentence"] in (ROOT / "README.md").read_text()
    for line in s["elastic_lines"]:
        assert line in evaluation

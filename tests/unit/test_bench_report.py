"""bench/report.py: docs/benchmarks.md is what the generator makes of the committed
JSON, and any bench JSON of the shared convention renders without a code change.
Pure file work (no processes)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_committed_page_equals_the_generated_one():
    results = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert results, "docs/results/ holds the benches' JSON"
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert committed == report.render(results), "docs/benchmarks.md is stale: run ./dev docs"


def test_a_new_bench_renders_without_a_code_change(tmp_path):
    doc = {
        "bench": "chaos-new",
        "machine": {"cpu_count": 2},
        "config": {"quick": True},
        "rows": [
            {"part": "kill", "what": "worker", "lost": 0, "ratio": 1.23456, "t": {"p50": 0.5}},
            {"part": "kill", "what": "store", "lost": 1, "ratio": float("nan"), "xs": [1, 2]},
            {"part": "partition", "hosts": 3, "runs": list(range(10))},
        ],
        "summary": {"lost_total": 1, "all_recovered": False},
    }
    p = tmp_path / "chaos-new.json"
    p.write_text(json.dumps(doc))
    text = report.render([p])
    assert "## chaos-new" in text
    assert "bench/chaos-new.py --quick --json" in text
    assert "#### kill" in text and "#### partition" in text
    assert "| what | lost | ratio | t.p50 | xs |" in text
    assert "| worker | 0 | 1.235 | 0.5 | - |" in text
    assert "| store | 1 | - | - | 1, 2 |" in text
    assert "| 3 | 10 |" in text  # a long list by its length
    assert "| all_recovered | false |" in text


def test_a_file_that_is_not_a_bench_json_is_named(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"bench": "x", "rows": []}))
    with pytest.raises(ValueError, match=r"x\.json.*summary"):
        report.render([p])


def test_marked_blocks_carry_their_bench_section():
    md = "### A\n| a |\n\n### Flex and elastic (x)\n| r1 |\n| r2 |\n\n### Memory\n| m |"
    page = (
        "intro\n"
        '<!-- generated: sim "### Flex and elastic" -->\nold text\n<!-- /generated -->\n'
        '<!-- generated: other "### A" -->\nkept\n<!-- /generated -->\nend\n'
    )
    got = report.refresh_marked(page, {"sim": {"markdown": md}})
    assert "old text" not in got and "| r1 |\n| r2 |" in got and "| m |" not in got
    assert "kept" in got  # no JSON for that bench: left as it is
    assert report.refresh_marked(got, {"sim": {"markdown": md}}) == got  # stable


def test_committed_marked_blocks_equal_the_generated_ones():
    results = sorted((ROOT / "docs" / "results").glob("*.json"))
    for page, text in report.marked_pages(results).items():
        assert page.read_text() == text, f"{page.name} is stale: run ./dev docs"

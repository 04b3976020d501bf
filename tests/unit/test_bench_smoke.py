"""Every bench still runs: each entry point in ``bench/`` once, small, with its JSON
written to a temporary folder (never over ``docs/results/``), then rendered by
``bench/report.py`` as ``./dev docs`` renders it (to stdout only). A bench that rots (an adapter's
surface moved under it) fails here, not at the next release's measurement.

Each runs its ``--quick`` made smaller with its own options where ``--quick`` takes
more than about a minute (``--smoke`` where it had none that would do); what is
asserted is exit status 0 and the JSON every bench writes (``bench``, ``machine``,
``rows``, ``summary``), not a figure. The root environment runs the benches that
need no engine (``bench/lightx2v.py`` among them: it drives the adapter, never
LightX2V); ``./dev engines NAME`` runs this file too, with ``MCD_ENGINE=NAME`` in that
engine's environment, where it runs ``bench/NAME.py`` when that bench needs the
engine (sglang, vLLM-Omni). ``bench/gpu.py`` without CUDA writes its "not run" JSON
(``tests/unit/test_gpu_bench_without_cuda.py``). Helper modules (``_common``,
``orch_*``, ``sim_*``, ``report``) are not entry points of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_diffusion.testing import descendants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

BENCH = Path(__file__).resolve().parents[2] / "bench"

#: bench -> its arguments besides ``--json`` (the root environment)
CORE = {
    "chaos": [
        "--quick",
        *("--skip", "scenarios", "--skip", "fuzz", "--skip", "soak"),
        *("--skip", "ha", "--skip", "ha_loopback"),
    ],
    "e2e": ["--quick"],
    "front_door": ["--quick"],
    "gpu": ["--quick", "--sizes-mb", "4"],
    "ha": ["--smoke", "--objects", "2"],
    "lightx2v": ["--quick", "--repeats", "1"],
    "misses": ["--smoke"],
    "orchestrator": ["--smoke"],
    "overlap": ["--quick", "--repeats", "1"],
    "sim": ["--quick", "--seeds", "1", "--arrivals", "100", "--cells", "image-8xh100"],
    "transfer": ["--quick", "--sizes-mb", "1"],
}
#: engine -> its bench's arguments (run in that engine's environment)
ENGINES = {
    "sglang": ["--quick", "--sizes-mb", "16", "--repeats", "1"],
    "vllm_omni": ["--quick", "--sizes-mb", "16", "--repeats", "1"],
}
#: what every bench's JSON carries (``bench/report.py`` needs nothing else)
KEYS = {"bench", "machine", "rows", "summary"}

_ENGINE = os.environ.get("MCD_ENGINE", "")
CASES = ({_ENGINE: ENGINES[_ENGINE]} if _ENGINE in ENGINES else {}) if _ENGINE else CORE


def test_every_entry_point_is_smoked():
    """A new bench gets a row here (or is named a helper)."""
    helpers = {"_common", "orch_load", "orch_measure", "orch_report", "report"}
    helpers |= {"sim_model", "sim_report", "sim_search"}
    entry = {
        p.stem
        for p in BENCH.glob("*.py")
        if p.stem not in helpers and 'if __name__ == "__main__"' in p.read_text()
    }
    assert entry == set(CORE) | set(ENGINES)


if CASES:  # none in an engine's environment without a bench of its own

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_the_bench_runs_and_writes_its_json(name, tmp_path):
        children = descendants(os.getpid())
        out = tmp_path / f"{name}.json"
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(BENCH / f"{name}.py"), *CASES[name], "--json", str(out)],
            capture_output=True, text=True, timeout=1100, cwd=BENCH.parent,
        )  # fmt: skip
        took = time.monotonic() - t0
        assert proc.returncode == 0, f"{name}: rc {proc.returncode}\n{proc.stderr[-4000:]}"
        doc = json.loads(out.read_text())
        assert doc.keys() >= KEYS, sorted(doc)
        assert doc["bench"] == name
        assert isinstance(doc["rows"], list) and isinstance(doc["summary"], dict)
        assert doc["summary"], doc
        # to stdout: with -o it would also refresh the generated blocks under docs/
        render = subprocess.run(
            [sys.executable, str(BENCH / "report.py"), str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert render.returncode == 0, render.stderr
        assert f"## {name}" in render.stdout
        print(f"bench smoke {name}: {took:.1f} s")
        deadline = time.monotonic() + 10  # leak check: the bench's processes are gone
        while (left := descendants(os.getpid()) - children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"{name} left processes behind: {sorted(left)}"

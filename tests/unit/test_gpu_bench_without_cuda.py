"""``bench/gpu.py`` on a machine without CUDA: nothing measured, said so in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def test_without_cuda_the_summary_lists_what_a_gpu_run_measures(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hide any device: the CPU contract
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--sizes-mb", "4,8", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "not run: no CUDA device" in proc.stdout
    result = json.loads(out.read_text())
    assert result["bench"] == "gpu" and result["rows"] == []
    summary = result["summary"]
    assert summary["cuda"] is False and summary["status"] == "not run: no CUDA device"
    assert "memcpy_d2d 8 MiB" in summary["would_measure"]
    assert "p2p_staged 4 MiB" in summary["would_measure"]
    assert len(summary["would_measure"]) == 12  # 6 measurements x 2 sizes
    assert "mooncake" in result["machine"]


def test_bad_sizes_are_refused_with_a_message():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--sizes-mb", "a,b"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--sizes-mb" in proc.stderr

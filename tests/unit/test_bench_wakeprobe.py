"""The orchestrator bench's wake probe (``--wake-probe``) reports how late the machine
woke it (issue 33): a probe held stopped (SIGSTOP) for 80 ms must report a wake-up
at least that late, and it counts only from its start line to its stop line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench" / "orchestrator.py"


def test_the_wake_probe_reports_a_stop_it_was_held_in():
    baseline = thread_names()
    probe = subprocess.Popen(
        [sys.executable, str(BENCH), "--wake-probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert probe.stdin is not None and probe.stdout is not None
        assert probe.stdout.readline().strip() == "ready"
        time.sleep(0.1)  # not started: this wait is not counted
        probe.stdin.write("start\n")
        probe.stdin.flush()
        started = time.monotonic()
        time.sleep(0.1)  # in its loop now (it only reads stdin there)
        os.kill(probe.pid, signal.SIGSTOP)
        time.sleep(0.08)
        os.kill(probe.pid, signal.SIGCONT)
        time.sleep(0.1)
        out, _ = probe.communicate("stop\n", timeout=60)
        ran_s = time.monotonic() - started
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    assert probe.returncode == 0
    late = json.loads(out)
    assert all(isinstance(x, float) for x in late) and len(late) >= 5
    assert max(late) >= 70.0  # the stop, as one late wake-up (ms)
    assert len(late) <= ran_s / 0.002 + 2  # wake-ups from its start line to its stop line
    assert_no_leaks(None, baseline)

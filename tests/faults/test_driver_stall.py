"""An orchestrator that could not run for longer than its workers' heartbeat
timeout keeps them (``orchestrator/service/stalls.py``). Its process is stopped
(SIGSTOP) with four live worker processes beating every half second: when it
runs again, their beats sent meanwhile are queued behind one another, and the
core applies expiry before each event, so without the stall taken out of its
time the first beat it read would have it give up every worker whose beat
came later. Real processes: the orchestrator command, four stage workers and
Mooncake (the stack fixture). The stop is held for a fixed time (it has to
outlast the timeout; nothing races it)."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import time

import pytest

from mooncake_diffusion.orchestrator.worker import toy

pytestmark = pytest.mark.faults

HEARTBEAT_S = 2.0
STOPPED_S = 3 * HEARTBEAT_S


def _serving(cluster: dict) -> set[str]:
    return {w["worker_id"] for w in cluster["workers"] if w["state"] == "serving"}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_stopped_orchestrator_keeps_its_live_workers(stack):
    stack.heartbeat_timeout = HEARTBEAT_S  # they beat every 0.5 s (a quarter of it)
    orch = stack.start_orchestrator()
    ids = ("enc-0", "den-0", "den-1", "dec-0")
    for wid, stage in zip(ids, ("encode", "denoise", "denoise", "decode"), strict=True):
        stack.start_worker(stage, wid)
    stack.clean_exit = (*ids, "orchestrator")
    c = stack.client
    deadline = time.monotonic() + 60
    while _serving(c.cluster()) != set(ids):
        assert time.monotonic() < deadline, c.cluster()
        time.sleep(0.1)

    os.kill(orch.popen.pid, signal.SIGSTOP)
    try:
        time.sleep(STOPPED_S)
    finally:
        os.kill(orch.popen.pid, signal.SIGCONT)

    params = {"prompt": "after the stop", "size": 1024, "steps": 4}
    st = c.wait(c.submit(params), timeout=90)
    assert st["state"] == "completed", st
    out = json.loads(base64.b64decode(st["output"]))["checksum"]
    assert out == pytest.approx(toy.expected_checksum(params), rel=1e-6)
    assert _serving(c.cluster()) == set(ids)
    text = c.metrics_text()
    assert _metric(text, "mcd_orchestrator_workers_removed_total") == 0, text
    stalled = _metric(text, "mcd_orchestrator_driver_stall_seconds_total")
    assert stalled >= STOPPED_S - 0.5, stalled  # the stop, as the watch saw it

"""An orchestrator that could not run for longer than its workers' heartbeat
timeout keeps them (``orchestrator/service/stalls.py``). Its process is stopped
(SIGSTOP) with four live worker processes beating every half second: when it
runs again, their beats sent meanwhile are queued behind one another, and the
core applies expiry before each event, so without the stall taken out of its
time the first beat it read would have it give up every worker whose beat
came later. Real processes: the orchestrator command, four stage workers and
Mooncake (the stack fixture). The stop is held for a fixed time (it has to
outlast the timeout; nothing races it).

Where the stop lands matters: a worker's allowance after the stop is the timeout
less how long ago the orchestrator last heard it when it stopped (and less the
first turn after it, reading the queued frames). On a loaded machine a worker's
beat can be a second late at any moment, and a stop landing then left it too
little (a worker was once removed at load 14-18). So the stop is sent only right
after a reading, itself quick, that has the orchestrator hearing every worker
within one beat period: the premise of the test (live workers beating every half
second), checked rather than assumed."""

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
BEAT_S = HEARTBEAT_S / 4  # the beat period the orchestrator gives its workers
STOPPED_S = 3 * HEARTBEAT_S
#: the stop lands only once every worker was heard within this: a period and a half,
#: so a worker whose beat is late (on a starved machine) is waited for, and at least
#: 1.25 s of the timeout is left for the turn that reads the queued frames
FRESH_S = 1.5 * BEAT_S


def _serving(cluster: dict) -> set[str]:
    return {w["worker_id"] for w in cluster["workers"] if w["state"] == "serving"}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _stop_when_all_heard(c, pid: int, ids: tuple[str, ...], hang_guard: float = 120) -> float:
    """SIGSTOP ``pid`` right after a reading of the cluster in which every one of
    ``ids`` is serving and was heard within ``FRESH_S``, counting the time the reading
    took (the ages are as of some moment inside it); returns that oldest age. Readings
    that fail it (a late beat, a slow answer) are dropped and taken again."""
    deadline = time.monotonic() + hang_guard
    while True:
        t0 = time.monotonic()
        workers = {w["worker_id"]: w for w in c.cluster()["workers"]}
        took = time.monotonic() - t0
        ages = [
            workers[i]["heartbeat_age_s"]
            for i in ids
            if i in workers and workers[i]["state"] == "serving"
        ]
        if len(ages) == len(ids) and max(ages) + took <= FRESH_S:
            os.kill(pid, signal.SIGSTOP)
            return max(ages) + took
        assert time.monotonic() < deadline, f"never all heard within {FRESH_S} s: {workers}"
        time.sleep(0.02)


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

    age = _stop_when_all_heard(c, orch.popen.pid, ids)
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
    assert _metric(text, "mcd_orchestrator_workers_removed_total") == 0, (age, text)
    stalled = _metric(text, "mcd_orchestrator_driver_stall_seconds_total")
    assert stalled >= STOPPED_S - 0.5, stalled  # the stop, as the watch saw it

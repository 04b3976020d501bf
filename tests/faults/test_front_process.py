"""``orchestrator --front-process``: the HTTP front in a child process, over real
processes and real Mooncake (store mode). A request goes through it end to end; the
front's process SIGKILLed while a request is held inside denoise is started again on
the same listening socket, and the request completes once, seen through the new
front; SIGTERM stops the service and its front (exit 0, no process left). The fault
lands at a known point: the denoise worker holds the request inside step 2
(``gated:toy_denoise``) until the test releases it."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess

import pytest
from gated import Gate
from servicestack import CLI

from mooncake_diffusion.orchestrator.worker import toy
from mooncake_diffusion.testing import descendants, non_loopback_listeners

pytestmark = pytest.mark.faults

GATED = "gated:toy_denoise"


def fronts_of(pid: int) -> list[int]:
    """The live front (``orchestrator.http.process``) processes below ``pid``."""
    found = []
    for p in descendants(pid) - {pid}:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"orchestrator.http.process" in f.read():  # a zombie's is empty
                    found.append(p)
        except OSError:
            continue  # gone meanwhile
    return found


def test_a_killed_front_is_started_again_and_loses_no_request(stack, tmp_path):
    gate = Gate(tmp_path)
    orch = stack.start_orchestrator("--front-process")
    stack.start_worker("encode", "enc-0")
    stack.start_worker("denoise", "den-0", fn=GATED, env=gate.env(2))
    stack.start_worker("decode", "dec-0")
    stack.clean_exit = ("enc-0", "den-0", "dec-0", "orchestrator")
    c = stack.client
    (front,) = fronts_of(orch.popen.pid)
    assert non_loopback_listeners(front) == []  # the inherited API socket, on loopback
    params = {"prompt": "through the front", "size": 2048, "steps": 4}
    rid = c.submit(params)
    gate.wait_reached(rid)  # held inside denoise step 2
    os.kill(front, signal.SIGKILL)
    orch.wait_for(r"front's process exited \(rc -9\); starting another")
    gate.release(rid)
    st = c.wait(rid, timeout=90)  # its polls reach the new front on the same socket
    assert st["state"] == "completed", st
    out = json.loads(base64.b64decode(st["output"]))
    assert out["checksum"] == pytest.approx(toy.expected_checksum(params), rel=1e-6)
    assert [e["kind"] for e in st["events"]].count("completed") == 1, st["events"]
    (again,) = fronts_of(orch.popen.pid)
    assert again != front
    pid = orch.popen.pid
    assert orch.terminate() == 0
    assert fronts_of(pid) == [] and not os.path.exists(f"/proc/{again}"), "a front outlived it"


def test_front_process_and_etcd_exclude_each_other():
    run = subprocess.run(
        [*CLI, "orchestrator", "--front-process", "--etcd", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode != 0
    assert "--front-process and --etcd exclude each other" in run.stderr, run.stderr

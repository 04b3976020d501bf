"""Every Mooncake listener on the configured host (loopback by default): the store host
that ``LocalCluster`` starts and ``mooncake-diffusion worker`` processes started the way
the demo starts them (``bindshim.env``, here through ``tests/servicestack.py``) listen
on loopback only, Transfer Engine included, and a request still moves its bytes through
every stage over those listeners. Listeners are read from ``/proc``."""

from __future__ import annotations

import base64
import json
import os
import threading

import pytest
from servicestack import ServiceStack

from mooncake_diffusion.orchestrator.worker.toy import expected_checksum
from mooncake_diffusion.testing import (
    assert_no_leaks,
    descendants,
    non_loopback_listeners,
    tcp_listeners,
)

pytestmark = pytest.mark.integration


def _store_host_pid() -> int:
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"mooncake_diffusion.transfer.store_host" in f.read():
                    return pid
        except OSError:
            continue
    raise AssertionError("no store host below this process")


def test_mooncake_processes_listen_on_the_configured_host_only(tmp_path, mooncake_cluster):
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    assert "LD_PRELOAD" not in os.environ and "MCD_BIND_HOST" not in os.environ
    stack = ServiceStack(tmp_path, mooncake_cluster.settings.as_env())
    try:
        stack.start_orchestrator()
        for stage in ("encode", "denoise", "decode"):
            stack.start_worker(stage, f"{stage}-0", wait=False)
        stack.ready()
        p = {"prompt": "through every listener", "size": 4096}
        st = stack.client.wait(stack.client.submit(p), timeout=120)
        assert st["state"] == "completed", st
        out = json.loads(base64.b64decode(st["output"]))
        assert out["checksum"] == expected_checksum(p)
        # each process holding a Transfer Engine listens (handshake and data listeners)
        store = _store_host_pid()
        assert len(tcp_listeners(store)) >= 2, tcp_listeners(store)
        for wid, proc in stack.workers.items():
            assert len(tcp_listeners(proc.pid)) >= 2, (wid, tcp_listeners(proc.pid))
        assert non_loopback_listeners(os.getpid()) == []
    finally:
        rcs = stack.close()
    assert all(rc == 0 for rc in rcs.values()), rcs
    assert_no_leaks(mooncake_cluster, baseline)

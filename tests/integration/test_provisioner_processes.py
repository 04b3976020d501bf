"""Elastic pools with real worker processes over real Mooncake (store mode): the
service in library mode (this process) and stage workers that ``LocalProvisioner``
starts and stops. The planner's rounds are driven by the test (``plan_now``, the
interval is never reached) and the work is held with gates (``tests/gated.py``),
so every decision is made on a known state, never raced."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig
from mooncake_diffusion.orchestrator.elastic.contract import AddWorker, Retire
from mooncake_diffusion.orchestrator.elastic.planners import ReactivePlanner, StaticPlanner
from mooncake_diffusion.orchestrator.elastic.provision import LocalProvisioner
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.orchestrator.worker import toy

pytestmark = pytest.mark.integration

TOY = "mooncake_diffusion.orchestrator.worker.toy"
NEVER = 1e9  # planner interval: rounds run only when the test calls plan_now()


class Elastic:
    """A library-mode service with a planner, and a provisioner of worker processes."""

    def __init__(self, tmp: Path, env: dict[str, str], planner: Any, fn: str = TOY) -> None:
        cfg = ServiceConfig(
            orchestrator=OrchestratorConfig(heartbeat_timeout=30.0),
            worker_bind="tcp://127.0.0.1:0",
        )
        self.svc = OrchestratorService(cfg, planner=planner).start()
        self.prov = LocalProvisioner(self.svc.worker_address, env, tmp / "logs", fn=fn)
        self.svc.use_planner(planner, self.prov)

    def workers(self, n: int, timeout: float = 120.0) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while True:
            view = {w["worker_id"]: w for w in self.svc.cluster()["workers"]}
            if len(view) >= n:
                return view
            self.prov.check()
            assert time.monotonic() < deadline, f"workers up: {sorted(view)}"
            time.sleep(0.05)

    def close(self, cluster: Any) -> None:
        """Once the workers have released every payload (soon after the outcomes),
        stop them and the service."""
        deadline = time.monotonic() + 15
        while cluster.keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.prov.close()
        self.svc.close()


def checksum(st: Any) -> float:
    return json.loads(st.output)["checksum"]


def test_the_local_provisioner_adds_and_removes_worker_processes(tmp_path, mooncake_cluster):
    el = Elastic(tmp_path, mooncake_cluster.settings.as_env(), StaticPlanner(interval=NEVER))
    try:
        ids = [el.prov.add((s,)) for s in ("encode", "denoise", "decode", "denoise")]
        assert ids == ["enc-0", "den-0", "dec-0", "den-1"]
        with pytest.raises(ValueError, match="at least one"):
            el.prov.add(())
        el.workers(4)
        params = {"prompt": "p", "size": 256, "steps": 3}
        st = el.svc.wait(el.svc.submit(params), timeout=60)
        assert st.state == "completed" and checksum(st) == pytest.approx(
            toy.expected_checksum(params), rel=1e-6
        )
        el.prov.remove("den-1")  # SIGTERM: it drains, says goodbye, exits
        el.prov.remove("den-1")  # idempotent
        el.prov.remove("never-started")
        deadline = time.monotonic() + 60  # it leaves the pool, then its process ends
        while "den-1" in {w["worker_id"] for w in el.svc.cluster()["workers"]} or (
            "den-1" in el.prov.workers()
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sorted(el.prov.workers()) == ["dec-0", "den-0", "enc-0"]
        el.prov.check()  # a removed worker's exit is not an error
    finally:
        el.close(mooncake_cluster)
    assert el.prov.workers() == []


def test_the_planner_adds_a_worker_it_lacks_and_retires_an_idle_one(tmp_path, mooncake_cluster):
    planner = ReactivePlanner(interval=NEVER, hold=1, max_workers=4, idle_retire=1, cooldown=0)
    el = Elastic(tmp_path, mooncake_cluster.settings.as_env(), planner)
    try:
        for s in ("encode", "decode"):
            el.prov.add((s,))
        el.workers(2)
        params = {"prompt": "p", "size": 256, "steps": 3}
        rid = el.svc.submit(params)  # no denoise worker, and none to spare: it waits
        deadline = time.monotonic() + 60
        while el.svc.cluster()["queued"]["denoise"] != [rid]:
            assert time.monotonic() < deadline, el.svc.cluster()
            time.sleep(0.05)
        [add] = el.svc.plan_now()
        assert isinstance(add, AddWorker) and add.stages == ("denoise",), add
        assert "den-0" in el.prov.workers()  # started by the provisioner, registers itself
        st = el.svc.wait(rid, timeout=120)
        assert st.state == "completed" and checksum(st) == pytest.approx(
            toy.expected_checksum(params), rel=1e-6
        )
        el.prov.add(("encode",))  # one more than the load needs
        el.workers(4)
        assert el.svc.plan_now() == [Retire("enc-1", "encode idle for 2 intervals")]
        while "enc-1" in el.prov.workers():  # drained, removed, given back: it exits
            assert time.monotonic() < deadline + 60
            time.sleep(0.05)
        view = el.svc.cluster()
        assert view["pools"] == {"encode": 1, "denoise": 1, "decode": 1}
        assert view["counters"]["planner:add"] == 1 and view["counters"]["planner:retire"] == 1
    finally:
        el.close(mooncake_cluster)

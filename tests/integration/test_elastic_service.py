"""The service runs a planner: decisions reach the core, pools and stage changes are
seen from outside (/metrics, /v1/cluster). In-process: real sockets on loopback,
StageWorkers with toy stages over the in-memory transport; the planner round is
driven by the test (``plan_now``), never by the clock."""

from __future__ import annotations

import threading
import time

import pytest
from apistack import Stack
from prometheus_client.parser import text_string_to_metric_families

from mooncake_diffusion.orchestrator.elastic.contract import Move
from mooncake_diffusion.orchestrator.elastic.planners import ReactivePlanner, StaticPlanner
from mooncake_diffusion.orchestrator.worker import toy

pytestmark = pytest.mark.integration

NEVER = 1e9  # a planner interval the test never reaches: rounds run by plan_now()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def wait_workers(stack: Stack, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(stack.svc.cluster()["workers"]) < n:
        assert time.monotonic() < deadline, stack.svc.cluster()
        time.sleep(0.02)


def test_pools_and_planner_metrics_are_exported_and_static_changes_nothing():
    stack = Stack(planner=StaticPlanner(interval=NEVER))
    try:
        stack.pipeline()
        stack.worker("encode", worker_id="enc-1")  # ids default to stage-host-pid
        wait_workers(stack, 4)
        assert stack.svc.plan_now() == []
        view = stack.svc.cluster()
        assert view["pools"] == {"encode": 2, "denoise": 1, "decode": 1}
        assert view["stage_changes"] == [] and view["changing"] == []
        assert {w["state"] for w in view["workers"]} == {"serving"}
        text = stack.client.metrics_text()
        pools = samples(text, "mcd_orchestrator_pool_workers")
        assert pools[(("stage", "encode"),)] == 2 and pools[(("stage", "denoise"),)] == 1
        assert samples(text, "mcd_orchestrator_stage_changes_total") == {(): 0.0}
        decisions = samples(text, "mcd_orchestrator_planner_decisions_total")
        assert decisions[(("kind", "move"),)] == 0
    finally:
        stack.close_released()


def test_a_planner_decision_reaches_the_core_and_is_counted():
    """The moved worker's load is held on a gate until the view is read: a load that
    ended first (without the gate these workers have no loader, fail the load at
    once and serve encode again) would leave nothing changing to see."""
    # max_wait 0 and hold 1: the first round with a queued denoise item moves a worker
    stack = Stack(planner=ReactivePlanner(interval=NEVER, hold=1, max_wait=0.0))
    gate = threading.Event()

    def held_loader(stage: str):  # type: ignore[no-untyped-def]
        gate.wait(60)
        return getattr(toy, stage)

    try:
        for i, stage in enumerate(("encode", "encode", "decode")):
            stack.worker(stage, worker_id=f"{stage[:3]}-{i}", loader=held_loader)
        wait_workers(stack, 3)
        # no denoise worker at all: the submitted request queues at denoise
        rid = stack.client.submit({"prompt": "p", "size": 64, "steps": 1})
        deadline = time.monotonic() + 30
        while not stack.svc.cluster()["queued"]["denoise"]:
            assert time.monotonic() < deadline, stack.svc.cluster()
            time.sleep(0.02)
        decisions = stack.svc.plan_now()
        assert [type(d) for d in decisions] == [Move] and decisions[0].stages == ("denoise",)
        view = stack.svc.cluster()
        # the moved one serves nothing meanwhile
        assert view["pools"]["encode"] == 1, (decisions, view)
        moved = next(w for w in view["workers"] if w["worker_id"] == decisions[0].worker_id)
        assert moved["state"] in ("changing", "loading")
        text = stack.client.metrics_text()
        assert samples(text, "mcd_orchestrator_planner_decisions_total")[(("kind", "move"),)] == 1
        stack.client.cancel(rid)
    finally:
        gate.set()
        stack.close_released()

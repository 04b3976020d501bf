"""The planner moves a worker when the mix shifts, with real worker processes over real
Mooncake Store and the reference pipeline: the service in library mode (this
process) runs the reactive planner, ``LocalProvisioner`` starts the workers
(``--fn gated``: the reference stages, held where the test asks). Nothing is lost or
runs twice, and every output is bitwise the colocated run's.

Nothing is raced: the planner's rounds run when the test calls ``plan_now`` (its
interval is never reached), and the videos' queue is built behind a denoise job
the gate holds inside a step, so the round sees exactly the state the test made."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from gated import Gate
from test_pipeline_disaggregated import NO_KILL_HEARTBEAT_S, clear_embeddings, colocated, result

from mooncake_diffusion.caches.keys import EMB_ROOT
from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig
from mooncake_diffusion.orchestrator.elastic.contract import Move
from mooncake_diffusion.orchestrator.elastic.planners import ReactivePlanner
from mooncake_diffusion.orchestrator.elastic.provision import LocalProvisioner
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig

pytestmark = pytest.mark.faults

NEVER = 1e9  # the planner's interval: its rounds run only on plan_now()
IMAGES = [
    {"prompt": "a red fox", "negative_prompt": "blurry", "seed": 1, "steps": 4},
    {"prompt": "a blue jay", "negative_prompt": "blurry", "seed": 2, "steps": 4},
]
VIDEOS = [
    {"prompt": f"waves {i}", "negative_prompt": "blurry", "seed": 10 + i, "steps": 6, "frames": 5}
    for i in range(3)
]


def until(svc: OrchestratorService, what: str, ok: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {svc.cluster()}"
        time.sleep(0.05)


def only_embeddings(cluster: Any) -> bool:
    """Whether the store holds nothing but the cached negative-prompt embeddings."""
    left = cluster.keys()
    return all(k.startswith(EMB_ROOT) for k in left)


def done_by(st: Any) -> dict[str, list[str]]:
    """Per stage, the workers whose result counted (one each, or a stage ran twice)."""
    out: dict[str, list[str]] = {}
    for e in st.events:
        if e.kind == "done":
            out.setdefault(e.stage, []).append(e.worker_id)
    return out


def test_a_mix_shift_makes_the_planner_move_a_worker_nothing_lost_bitwise(
    tmp_path, mooncake_cluster
):
    gate = Gate(tmp_path)
    # short: more than one video waiting per denoise worker, none free (no wait needed)
    planner = ReactivePlanner(interval=NEVER, hold=1, max_wait=600.0, depth=1.0)
    cfg = ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=NO_KILL_HEARTBEAT_S),
        worker_bind="tcp://127.0.0.1:0",
    )
    svc = OrchestratorService(cfg).start()
    env = {**mooncake_cluster.settings.as_env(), **gate.env()}
    prov = LocalProvisioner(svc.worker_address, env, tmp_path / "logs", fn="gated")
    try:
        svc.use_planner(planner, prov)
        for wid, stage, n in (("enc-0", "encode", 1), ("enc-1", "encode", 1)):
            prov.add((stage,), wid, n)
        prov.add(("denoise",), "den-0")
        prov.add(("decode",), "dec-0", 3)  # a latent slot per denoise job, and a spare
        until(svc, "4 workers", lambda: len(svc.cluster()["workers"]) == 4)

        # images: the pools fit, nothing waits, the planner changes nothing
        images = [svc.submit(p, request_id=f"img-{i}") for i, p in enumerate(IMAGES)]
        for rid in images:
            assert svc.wait(rid, timeout=240).state == "completed"
        assert svc.plan_now() == []

        # videos: vid-0 is held inside denoise step 2 on den-0, the others queue behind it
        gate.hold("vid-0", "denoise", 2)
        videos = [svc.submit(VIDEOS[0], request_id="vid-0")]
        assert gate.wait_reached("vid-0") == "den-0"
        videos += [svc.submit(p, request_id=f"vid-{i}") for i, p in enumerate(VIDEOS) if i]
        until(svc, "2 videos queued", lambda: len(svc.cluster()["queued"]["denoise"]) == 2)
        decisions = svc.plan_now()
        assert [type(d) for d in decisions] == [Move], decisions
        moved = decisions[0].worker_id
        assert moved in ("enc-0", "enc-1") and decisions[0].stages == ("denoise",)
        assert svc.plan_now() == []  # encode keeps its last worker: nothing more to give

        def serving_denoise() -> bool:
            w = {w["worker_id"]: w for w in svc.cluster()["workers"]}[moved]
            return w["state"] == "serving" and w["stages"] == ["denoise"]

        until(svc, f"{moved} serving denoise", serving_denoise)
        gate.release("vid-0")
        finals = {rid: svc.wait(rid, timeout=240) for rid in images + videos}
        view = svc.cluster()
    finally:
        deadline = time.monotonic() + 15  # the workers release payloads soon after outcomes
        while time.monotonic() < deadline and not only_embeddings(mooncake_cluster):
            time.sleep(0.1)
        prov.close()
        svc.close()
    clear_embeddings(mooncake_cluster)

    for (rid, st), p in zip(finals.items(), IMAGES + VIDEOS, strict=True):
        assert st.state == "completed" and not st.reasons, (rid, st)
        assert json.loads(st.output)["sha256"] == colocated(p), rid  # bitwise colocated
        by = done_by(st)
        assert sorted(by) == ["decode", "denoise", "encode"], (rid, by)
        assert all(len(ws) == 1 for ws in by.values()), (rid, by)  # nothing ran twice
        assert not [e for e in st.events if e.kind in ("requeued", "failed")], st.events
    denoised = [done_by(finals[r])["denoise"][0] for r in videos]
    assert denoised[0] == "den-0" and moved in denoised[1:], denoised
    assert [(c["worker_id"], c["before"], c["stages"]) for c in view["stage_changes"]] == [
        (moved, ["encode"], ["denoise"])
    ]
    assert view["counters"]["planner:move"] == 1 and view["pools"] == {
        "encode": 1,
        "denoise": 2,
        "decode": 1,
    }


def test_the_orchestrator_command_runs_the_planner_it_is_given(stack, tmp_path):
    """`orchestrator --planner reactive --planner-option ...`: rounds on the wall clock
    (every 0.2 s), against a state the gate holds until the move has landed."""
    gate = Gate(tmp_path)
    stack.heartbeat_timeout = NO_KILL_HEARTBEAT_S
    stack.after_close.append(clear_embeddings)
    stack.lasting = (EMB_ROOT,)
    options = ("interval=0.2", "hold=2", "depth=1", "max_wait=600")
    stack.start_orchestrator("--planner", "reactive", *(f"--planner-option={o}" for o in options))
    for wid, stage, n in (("enc-0", "encode", 1), ("enc-1", "encode", 1), ("den-0", "denoise", 1)):
        stack.start_worker((stage,), wid, n, fn="gated", env=gate.env(), wait=False)
    stack.start_worker(("decode",), "dec-0", 3, fn="gated", env=gate.env(), wait=False)
    stack.ready()
    stack.clean_exit = ("enc-0", "enc-1", "den-0", "dec-0", "orchestrator")
    c = stack.client
    gate.hold("vid-0", "denoise", 2)
    rids = [c.submit(VIDEOS[0], request_id="vid-0")]
    assert gate.wait_reached("vid-0") == "den-0"
    rids += [c.submit(p, request_id=f"vid-{i}") for i, p in enumerate(VIDEOS) if i]
    deadline = time.monotonic() + 120
    while not (changes := c.cluster()["stage_changes"]):  # two rounds see the queue
        assert time.monotonic() < deadline, c.cluster()
        time.sleep(0.1)
    assert [(x["before"], x["stages"]) for x in changes] == [(["encode"], ["denoise"])]
    gate.release("vid-0")
    for rid, p in zip(rids, VIDEOS, strict=True):
        st = c.wait(rid, timeout=240)
        assert st["state"] == "completed" and not st.get("reasons"), st
        assert result(st)["sha256"] == colocated(p), rid
    text = c.metrics_text()
    assert 'mcd_orchestrator_planner_decisions_total{kind="move"} 1.0' in text
    assert 'mcd_orchestrator_pool_workers{stage="denoise"} 2.0' in text

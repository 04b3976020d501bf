"""Elastic pools with real processes over real Mooncake Store and the reference
pipeline: a worker that holds every stage, stage changes while items are in
flight, and a denoise worker leaving mid-video (drained by the service, or given
SIGTERM) whose job moves through its step checkpoint to another worker. Every
output is bitwise the colocated run's; nothing is lost or runs twice.

Each change lands where it must: the workers run ``--fn gated`` (the reference
stages, held where the test asks), so a denoise job is held inside step 5 until
the orchestrator asks it to yield, and a decode item is held before it starts
until the test lets it go; no test races the work."""

from __future__ import annotations

import pytest
from gated import Gate
from servicestack import ServiceStack
from test_pipeline_disaggregated import NO_KILL_HEARTBEAT_S, clear_embeddings, colocated, result

from mooncake_diffusion.caches.keys import EMB_ROOT

pytestmark = pytest.mark.faults

STEP = 5  # a denoise job is held inside this step (checkpoints every 2: 2 and 4 saved)
VIDEO = {"prompt": "a long one", "negative_prompt": "bad", "seed": 9, "steps": 16, "frames": 5}
ALL = ("encode", "denoise", "decode")


def start(
    stack: ServiceStack,
    gate: Gate,
    workers: dict[str, tuple[str, ...]],
    credits: dict[str, int] | None = None,
) -> None:
    """The orchestrator and ``workers`` (id -> stages; ``credits``: id -> credits, 1
    if not given), each serving the reference stages through ``gated`` (module
    form: any stage, for stage changes too)."""
    stack.after_close.append(clear_embeddings)
    stack.lasting = (EMB_ROOT,)
    stack.start_orchestrator()
    for wid, stages in workers.items():
        env = gate.env(STEP, until="yield")
        n = (credits or {}).get(wid, 1)
        stack.start_worker(stages, wid, n, fn="gated", env=env, wait=False)
    stack.ready()
    stack.clean_exit = (*workers, "orchestrator")


def done_by(st: dict) -> dict[str, list[str]]:
    """Per stage, the workers whose result counted (one each, or a stage ran twice)."""
    out: dict[str, list[str]] = {}
    for e in st["events"]:
        if e["kind"] == "done":
            out.setdefault(e["stage"], []).append(e["worker_id"])
    return out


def completed(stack: ServiceStack, rid: str, params: dict) -> dict:
    st = stack.client.wait(rid, timeout=240)
    assert st["state"] == "completed" and not st.get("reasons"), st
    assert result(st)["sha256"] == colocated(params), params
    return st


def test_a_worker_holding_every_stage_serves_requests_end_to_end(stack, tmp_path):
    stack.heartbeat_timeout = NO_KILL_HEARTBEAT_S
    start(stack, Gate(tmp_path), {"all-0": ALL})
    image = {"prompt": "a red fox", "negative_prompt": "blurry", "seed": 1, "steps": 4}
    video = {"prompt": "waves", "negative_prompt": "blurry", "seed": 3, "steps": 3, "frames": 5}
    rids = [stack.client.submit(p) for p in (image, video)]
    for rid, p in zip(rids, (image, video), strict=True):
        st = completed(stack, rid, p)
        assert done_by(st) == {s: ["all-0"] for s in ALL}, st["events"]
    view = stack.client.cluster()["workers"]
    assert [(w["worker_id"], w["stages"]) for w in view] == [("all-0", list(ALL))]


@pytest.mark.parametrize("notice", ["drain", "sigterm"])
def test_a_denoise_worker_leaving_mid_video_moves_its_job_through_a_checkpoint(
    stack, tmp_path, notice
):
    gate = Gate(tmp_path)
    stack.heartbeat_timeout = NO_KILL_HEARTBEAT_S  # nothing here may go by a missed beat
    workers = {"enc-0": ("encode",), "den-0": ("denoise",), "den-1": ("denoise",)}
    start(stack, gate, {**workers, "dec-0": ("decode",)})
    rid = stack.client.submit(VIDEO)
    leaving = gate.wait_reached(rid)  # held inside step 5 until asked to yield
    if notice == "drain":  # a planner's scale-down, through the service
        assert stack.client.drain(leaving, "scale-down") == "draining"
    else:  # spot loss with notice: SIGTERM, the worker tells the orchestrator
        stack.workers[leaving].signal_term()
    # it hands the job back at the step boundary and exits by itself
    assert stack.workers[leaving].popen.wait(120) == 0
    st = completed(stack, rid, VIDEO)  # bitwise the uninterrupted run
    den = [e for e in st["events"] if e["kind"] == "done" and e["stage"] == "denoise"]
    assert len(den) == 1 and den[0]["worker_id"] != leaving, den
    assert den[0]["info"]["resumed_from"] == 4, den  # its checkpoint, not step 0
    moved = [(e["kind"], e.get("worker_id")) for e in st["events"] if e["kind"] == "yielded"]
    assert moved == [("yielded", leaving)], st["events"]
    assert leaving not in [w["worker_id"] for w in stack.client.cluster()["workers"]]


def test_stage_changes_with_items_in_flight_lose_and_duplicate_nothing(stack, tmp_path):
    gate = Gate(tmp_path)
    stack.heartbeat_timeout = NO_KILL_HEARTBEAT_S
    workers = {"enc-0": ("encode",), "den-0": ("denoise",), "den-1": ("denoise",)}
    # two decode credits: the held video reserves one, the image's decode takes the other
    start(stack, gate, {**workers, "dec-0": ("decode",)}, {"dec-0": 2})
    c = stack.client
    image = {"prompt": "quick image", "negative_prompt": "bad", "seed": 6, "steps": 4}
    video = c.submit(VIDEO)
    moved = gate.wait_reached(video)  # the video's denoise, held inside step 5
    gate.hold("img", "decode", 0)
    c.submit(image, request_id="img")
    assert gate.reached("img", "decode")["worker_id"] == "dec-0"  # held before decoding

    # 1. a denoise worker becomes a decode worker while it runs the video
    assert c.reassign(moved, ["decode"], "mix moved to images") == "changing"
    stack.workers[moved].wait_for(rf"stage change: {moved} now holds decode \(loaded in")
    # 2. the decode worker becomes a denoise worker while its decode item is held
    assert c.reassign("dec-0", ["denoise"], "mix moved to videos") == "changing"
    view = {w["worker_id"]: w for w in c.cluster()["workers"]}
    assert view["dec-0"]["state"] == "changing" and "img" in view["dec-0"]["running"]
    gate.release("img", "decode")  # it finishes, then the worker loads denoise
    stack.workers["dec-0"].wait_for(r"stage change: dec-0 now holds denoise \(loaded in")
    later = {f"r{i}": {"prompt": f"later {i}", "seed": 20 + i, "steps": 3} for i in range(2)}
    for rid, p in later.items():
        c.submit(p, request_id=rid)

    st = completed(stack, video, VIDEO)
    assert [e.get("worker_id") for e in st["events"] if e["kind"] == "yielded"] == [moved]
    assert st["events"][-1]["kind"] == "completed"
    assert moved not in done_by(st)["denoise"]  # resumed elsewhere
    for rid, p in {"img": image, **later}.items():
        completed(stack, rid, p)
    for rid in (video, "img", *later):
        by = done_by(c.status(rid))
        assert all(len(ws) == 1 for ws in by.values()), (rid, by)  # nothing ran twice
        assert set(by) == set(ALL), (rid, by)
    for rid in later:  # the only decode worker now is the one that changed stage
        assert done_by(c.status(rid))["decode"] == [moved]
    assert done_by(c.status("img"))["decode"] == ["dec-0"]
    view = c.cluster()
    stages = {w["worker_id"]: w["stages"] for w in view["workers"]}
    assert stages[moved] == ["decode"] and stages["dec-0"] == ["denoise"], stages
    changes = view["stage_changes"]
    assert [(x["worker_id"], x["stages"]) for x in changes] == [
        (moved, ["decode"]),
        ("dec-0", ["denoise"]),
    ]
    assert all(x["load_s"] is not None and x["load_s"] >= 0 for x in changes), changes
    assert view["counters"]["stage_changes"] == 2

"""The reference pipeline disaggregated: Encode, Denoise and Decode worker processes
behind the orchestrator, bytes through real Mooncake Store. The outputs are bitwise
identical to the colocated run, and a denoise worker SIGKILLed mid-job is resumed on
another worker from its last step checkpoint (not from step 0), still bitwise.

The fault tests hold the denoise at a known step (``gated``: the worker blocks
inside step 5 until the test lets it go), so the kill and the preemption land
at step 5 on a fast idle machine and on a loaded one alike."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from gated import Gate
from servicestack import ServiceStack

from mooncake_diffusion.caches.checkpoint import CKPT_ROOT
from mooncake_diffusion.caches.embedding import EmbeddingCache
from mooncake_diffusion.caches.keys import EMB_ROOT
from mooncake_diffusion.orchestrator.worker.reference import frames_digest
from mooncake_diffusion.pipeline.params import GenerationParams
from mooncake_diffusion.pipeline.reference import ReferencePipeline

pytestmark = pytest.mark.faults

STAGES = "mooncake_diffusion.orchestrator.worker.reference"


def clear_embeddings(cluster) -> None:
    """The negative-prompt embeddings are meant to stay cached: only they may remain."""
    left = cluster.keys()
    assert all(k.startswith(EMB_ROOT) for k in left), left
    enc = ReferencePipeline().encoder_id
    cache = EmbeddingCache(cluster.settings, encoder_id=enc, encoder_version="1")
    try:
        cache.clear()
    finally:
        cache.close()


def checkpoints(cluster) -> list[str]:
    """The step-checkpoint keys the store holds."""
    keys = cluster.keys()
    return [k for k in keys if k.startswith(CKPT_ROOT)]


def colocated(p: dict) -> str:
    return frames_digest(ReferencePipeline().run_colocated(GenerationParams(**p)))


def result(st: dict) -> dict:
    return json.loads(base64.b64decode(st["output"]))


def start(
    stack: ServiceStack,
    denoise: int = 1,
    *extra: str,
    gate: dict[str, str] | None = None,
    outputs: Path | None = None,
    gated_fn: str = "denoise",
) -> None:
    """Orchestrator, one encode, ``denoise`` denoise and one decode worker; with ``gate``
    (``Gate.env(...)``) the denoise workers run ``gated:<gated_fn>`` under it; with
    ``outputs`` the decode worker saves files there (its ``MCD_OUTPUTS``)."""
    stack.after_close.append(clear_embeddings)
    stack.lasting = (EMB_ROOT,)
    stack.start_orchestrator(*extra)
    stack.start_worker("encode", "enc-0", fn=f"{STAGES}:encode", wait=False)
    for i in range(denoise):
        fn = f"gated:{gated_fn}" if gate else f"{STAGES}:denoise"
        stack.start_worker("denoise", f"den-{i}", fn=fn, env=gate, wait=False)
    env = {"MCD_OUTPUTS": str(outputs)} if outputs else None
    stack.start_worker("decode", "dec-0", fn=f"{STAGES}:decode", env=env, wait=False)
    stack.ready()


#: for tests that kill no worker: a heartbeat missed on a starved machine (5 s, the
#: fixture's, was missed at load average 29) must not requeue what they watch
NO_KILL_HEARTBEAT_S = 60.0


def test_disaggregated_outputs_are_bitwise_identical_to_colocated(stack, tmp_path):
    stack.heartbeat_timeout = NO_KILL_HEARTBEAT_S
    start(stack, outputs=tmp_path)
    stack.clean_exit = ("enc-0", "den-0", "dec-0", "orchestrator")
    reqs = [
        {"prompt": "a red fox", "negative_prompt": "blurry", "seed": 1, "steps": 4},
        {"prompt": "a blue jay", "negative_prompt": "blurry", "seed": 2, "steps": 4},
        {"prompt": "waves", "negative_prompt": "blurry", "seed": 3, "steps": 3, "frames": 9},
        {"prompt": "no cfg", "guidance": 1.0, "seed": 4, "steps": 3, "frames": 5},
    ]
    rids = [stack.client.submit({**p, "save": True, "chunks": 2}) for p in reqs]
    for rid, p in zip(rids, reqs, strict=True):
        st = stack.client.wait(rid, timeout=180)
        assert st["state"] == "completed", st
        out = result(st)
        assert out["sha256"] == colocated(p), (p, out)
        assert (tmp_path / out["path"].rsplit("/", 1)[-1]).exists()
    hits = [
        e["info"].get("cache_hit")
        for rid in rids
        for e in stack.client.status(rid)["events"]
        if e["kind"] == "done" and e["stage"] == "encode"
    ]
    # one negative prompt for three CFG requests: computed once, then read from the store
    assert hits.count(True) >= 1 and hits.count(False) >= 1, hits


def test_a_denoise_worker_killed_mid_job_resumes_from_its_checkpoint(stack, tmp_path):
    gate = Gate(tmp_path)
    start(stack, denoise=2, gate=gate.env(5))  # checkpoints every 2 steps: 2 and 4 saved
    stack.clean_exit = ("enc-0", "dec-0", "orchestrator")
    p = {"prompt": "a long one", "negative_prompt": "bad", "seed": 9, "steps": 16, "frames": 5}
    rid = stack.client.submit(p)
    victim = gate.wait_reached(rid)  # held inside step 5
    stack.workers[victim].kill()
    gate.release(rid)  # the survivor passes step 5 on its own (held once only)
    st = stack.client.wait(rid, timeout=180)
    assert st["state"] == "completed", st
    den = [e for e in st["events"] if e["kind"] == "done" and e["stage"] == "denoise"]
    assert len(den) == 1 and den[0]["worker_id"] != victim, den
    assert den[0]["info"]["resumed_from"] == 4, den  # its last checkpoint, not step 0
    assert result(st)["sha256"] == colocated(p)


def test_a_batch_video_yields_to_an_interactive_image_and_resumes_bitwise(stack, tmp_path):
    gate = Gate(tmp_path)
    stack.heartbeat_timeout = NO_KILL_HEARTBEAT_S
    # the video is held inside step 5 until the orchestrator asks it to yield
    start(stack, 1, "--preemption", gate=gate.env(5, until="yield"))
    stack.clean_exit = ("enc-0", "den-0", "dec-0", "orchestrator")
    c = stack.client
    video = {"prompt": "slow video", "negative_prompt": "bad", "seed": 5, "steps": 24, "frames": 9}
    image = {"prompt": "quick image", "negative_prompt": "bad", "seed": 6, "steps": 4}
    vid = c.submit(video, slo_class="batch")
    gate.wait_reached(vid)
    img = c.submit(image, slo_class="interactive")  # 4 steps: never reaches the gate
    img_st = c.wait(img, timeout=180)
    assert img_st["state"] == "completed", img_st
    vid_st = c.wait(vid, timeout=180)
    assert vid_st["state"] == "completed", vid_st
    kinds = [e["kind"] for e in vid_st["events"]]
    assert "preempted" in kinds and "yielded" in kinds, kinds
    assert not vid_st.get("reasons"), vid_st  # a yield is not a failure
    den = [e for e in vid_st["events"] if e["kind"] == "done" and e["stage"] == "denoise"]
    img_den = [e for e in img_st["events"] if e["kind"] == "done" and e["stage"] == "denoise"]
    assert len(den) == 1 and len(img_den) == 1, (den, img_den)
    assert img_den[0]["t"] < den[0]["t"], "the image did not pass the video on den-0"
    assert den[0]["info"]["resumed_from"] == 4, den  # resumed from its last checkpoint
    assert result(vid_st)["sha256"] == colocated(video)
    assert result(img_st)["sha256"] == colocated(image)


def test_a_request_whose_denoise_fails_on_every_attempt_leaves_no_checkpoint(
    stack, tmp_path, mooncake_cluster
):
    gate = Gate(tmp_path)
    # every attempt raises right after step 5 (the first one is held there first), so
    # the job's checkpoint of step 4 is saved and each retry resumes from it
    start(stack, 2, gate=gate.env(5, fail=5), gated_fn="failing_denoise")
    stack.clean_exit = ("enc-0", "den-0", "den-1", "dec-0", "orchestrator")
    p = {"prompt": "doomed", "negative_prompt": "bad", "seed": 11, "steps": 16, "frames": 5}
    rid = stack.client.submit(p)
    gate.wait_reached(rid)
    assert checkpoints(mooncake_cluster)
    gate.release(rid)
    st = stack.client.wait(rid, timeout=180)
    assert st["state"] == "failed", st
    reasons = st["reasons"]
    assert len(reasons) == 3 and all("injected failure after step 5" in r for r in reasons), st
    # the orchestrator has a denoise worker drop them once the request failed for good
    deadline = time.monotonic() + 30
    while (left := checkpoints(mooncake_cluster)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], left

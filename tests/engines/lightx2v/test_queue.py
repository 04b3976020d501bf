"""Queue mode on the real LightX2V: Encoder, Transformer and Decoder role processes
(``WanRunner``, configured by their JSON alone) as workers of a real orchestrator
process, over a real Mooncake master and store host. Requests are submitted to
the orchestrator's HTTP API with the body LightX2V's server takes; each role
runs an item as LightX2V's server worker runs a request; the Transformer's
``progress_callback(percent_float, 100)`` reaches the request's event stream."""

from __future__ import annotations

import base64
import json
import signal
import threading
import time

import pytest
from conftest import RoleGate, ok, request, role_config
from servicestack import ServiceStack

pytestmark = [pytest.mark.engines, pytest.mark.integration, pytest.mark.timeout(1200)]


@pytest.fixture
def stack(tmp_path, spawn_role, mooncake_cluster):
    """An orchestrator process (stopped before the roles are released and checked)."""
    s = ServiceStack(tmp_path, mooncake_cluster.settings.as_env(), heartbeat_timeout=5.0)
    yield s
    assert s.close()["orchestrator"] == 0


def wait_workers(client, ids: set[str], hang_guard: float = 600) -> None:
    deadline = time.monotonic() + hang_guard
    while time.monotonic() < deadline:
        if ids <= {w["worker_id"] for w in client.cluster()["workers"]}:
            return
        time.sleep(0.1)
    raise AssertionError(f"workers {ids} never registered: {client.cluster()['workers']}")


def test_queue_mode_completes_requests_with_progress_on_the_real_runner(
    spawn_role, stack, mooncake_cluster, image, tmp_path
):
    stack.start_orchestrator()
    roles = {}
    for mode, wid in (("encoder", "enc-0"), ("transformer", "tra-0"), ("decode", "dec-0")):
        queue = {"orchestrator": stack.worker_address, "worker_id": wid, "result_sha256": True}
        roles[wid] = spawn_role(wid, role_config(mode, mooncake_cluster, queue=queue))
    local = spawn_role("colocated", role_config(None, mooncake_cluster))
    client = stack.client
    wait_workers(client, set(roles))
    for seed in (21, 22):
        body = request(image, seed, save_result_path=str(tmp_path / f"q{seed}.mp4"))
        rid = client.submit(body, request_id=f"req-{seed}")
        events = list(client.events(rid))  # follows the stream until the request ends
        st = client.status(rid)
        assert st["state"] == "completed", st
        out = json.loads(base64.b64decode(st["output"]))
        assert out["request_id"] == rid and out["save_result_path"] == body["save_result_path"]
        assert (tmp_path / f"q{seed}.mp4").stat().st_size > 0  # the Decoder saved the video
        progress = [(e["step"], e["total"]) for e in events if e["kind"] == "progress"]
        # three denoising steps: LightX2V reports 33.3.., 66.6.., 100.0 of 100, kept
        # to a hundredth of a percent on the wire (see queue_mode.progress_steps)
        assert progress == [(3333, 10000), (6667, 10000), (10000, 10000)], events
        assert all(e["stage"] == "denoise" for e in events if e["kind"] == "progress")
        dispatched = [(e["stage"], e["worker_id"]) for e in events if e["kind"] == "dispatched"]
        assert dispatched == [("encode", "enc-0"), ("denoise", "tra-0"), ("decode", "dec-0")]
        ref = ok(local.request(op="run", seed=seed, task={**body, "save_result_path": None}))
        assert ref["status"] == "success", ref
        decoded = ok(roles["dec-0"].request(op="info"))["seen"]["vae_decode_input"]
        assert decoded == ref["seen"]["vae_decode_input"]  # byte for byte as colocated
    # a queue-mode role takes no work from LightX2V's own entry (its server's requests)
    direct = ok(roles["tra-0"].request(op="run", seed=1, task=request(image, 1)))
    assert direct["status"] == "failed" and "orchestrator" in direct["error"], direct
    deadline = time.monotonic() + 120
    while mooncake_cluster.keys() and time.monotonic() < deadline:
        time.sleep(0.1)  # the orchestrator's Release drops the retained outputs
    assert mooncake_cluster.keys() == []


def queue_roles(spawn_role, stack, cluster, ids: dict[str, str], **disagg) -> dict:
    """``{worker_id: mode}`` as queue-mode role processes of ``stack``'s orchestrator,
    registered; ``disagg``: more ``disagg_config`` keys for every role. With them,
    the ``"colocated"`` pipeline (LightX2V's, no disaggregation) to compare with."""
    made = {}
    for wid, (mode, credits) in ids.items():
        queue = {"orchestrator": stack.worker_address, "worker_id": wid, "credits": credits}
        made[wid] = spawn_role(wid, role_config(mode, cluster, queue=queue, **disagg))
    made["colocated"] = spawn_role("colocated", role_config(None, cluster))
    wait_workers(stack.client, set(ids))
    return made


def finished(client, rid: str) -> tuple[dict, list[dict]]:
    """``rid``'s events until it ends, and its status."""
    events = list(client.events(rid))
    return client.status(rid), events


def decoded(role, seed: int) -> dict:
    """What the decode role's VAE was given for ``seed`` (dtype, shape, SHA-256)."""
    return ok(role.request(op="info"))["seen"][f"vae_decode_input@{seed}"]


def colocated(role, body: dict) -> dict:
    ref = ok(role.request(op="run", seed=body["seed"], task={**body, "save_result_path": None}))
    assert ref["status"] == "success", ref
    return ref["seen"]["vae_decode_input"]


def test_one_requests_settings_do_not_reach_the_next_request(
    spawn_role, stack, mooncake_cluster, image, tmp_path
):
    """LightX2V's ``set_config`` keeps every key a request set: request B, which sets
    nothing, came out at A's ``fixed_shape`` (a 64x64 video, not the role's 64x96)."""
    stack.start_orchestrator()
    ids = {"enc-0": ("encoder", 1), "tra-0": ("transformer", 1), "dec-0": ("decode", 1)}
    roles = queue_roles(spawn_role, stack, mooncake_cluster, ids)
    client = stack.client
    a = request(image, 31, resize_mode="fixed_shape", fixed_shape=[64, 64])
    a["data_bootstrap_room"] = 7
    b = request(image, 32)
    seen = {}
    for name, body in (("a", a), ("b", b)):
        body["save_result_path"] = str(tmp_path / f"{name}.mp4")
        st, _ = finished(client, client.submit(body, request_id=f"req-{name}"))
        assert st["state"] == "completed", st
        seen[name] = decoded(roles["dec-0"], body["seed"])
    assert seen["a"]["shape"] == [16, 3, 8, 8]  # A's own settings did apply to A
    assert seen["b"] == colocated(roles["colocated"], b)  # byte for byte, at [16, 3, 8, 12]
    assert seen["b"]["shape"] == [16, 3, 8, 12]


def test_a_p2p_input_lost_with_its_producer_reruns_the_stage_that_made_it(
    spawn_role, stack, mooncake_cluster, image, tmp_path
):
    """The transformer that produced the latents (p2p: they stay in its memory until
    taken) is SIGKILLed after handing them over, before the decoder reads them: the
    decoder is stopped (SIGSTOP) from before the request until the kill. The decode
    finds its input gone and says so; the orchestrator re-runs the denoise on the
    other transformer (round robin: the next one) and the request completes, byte
    for byte as colocated (before: three decodes against the dead producer, then the
    request failed)."""
    stack.heartbeat_timeout = 60.0  # the stopped decoder stays registered meanwhile
    stack.start_orchestrator("--policy", "round_robin")
    ids = {
        "enc-0": ("encoder", 1),
        "tra-0": ("transformer", 1),
        "tra-1": ("transformer", 1),
        "dec-0": ("decode", 1),
    }
    roles = queue_roles(spawn_role, stack, mooncake_cluster, ids, transfer_mode="p2p")
    client = stack.client
    body = request(image, 42, save_result_path=str(tmp_path / "b.mp4"))
    decoder = roles["dec-0"].proc
    decoder.send_signal(signal.SIGSTOP)
    try:
        rid = client.submit(body, request_id="req-b")
        producer = None
        for e in client.events(rid):  # the denoise is done: its latents wait in the producer
            if (e["kind"], e.get("stage")) == ("dispatched", "denoise"):
                producer = e["worker_id"]
            if (e["kind"], e.get("stage")) == ("done", "denoise"):
                break
        assert producer in ("tra-0", "tra-1")
        roles[producer].proc.kill()
        roles[producer].proc.wait(60)
    finally:
        decoder.send_signal(signal.SIGCONT)
    st, events = finished(client, rid)
    assert st["state"] == "completed", (st, events)
    assert decoded(roles["dec-0"], 42) == colocated(roles["colocated"], body)
    reruns = [e for e in events if e["kind"] == "rerun"]
    assert [e["stage"] for e in reruns] == ["denoise"], events
    assert "PeerGoneError" in reruns[0]["reason"], reruns
    denoisers = [
        e["worker_id"] for e in events if (e["kind"], e.get("stage")) == ("dispatched", "denoise")
    ]
    survivor = ({"tra-0", "tra-1"} - {producer}).pop()
    assert denoisers == [producer, survivor], events


class Follow:
    """Every event of a request from its submission on, read on a thread (progress
    events are streamed, never kept in its history)."""

    def __init__(self, client, rid: str) -> None:
        self.events: list[dict] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(client, rid), daemon=True)
        self._thread.start()

    def _read(self, client, rid: str) -> None:
        try:
            for e in client.events(rid):
                self.events.append(e)
        except BaseException as e:
            self.error = e

    def wait(self, kind: str, hang_guard: float = 600.0) -> dict:
        deadline = time.monotonic() + hang_guard
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e["kind"] == kind:
                    return e
            time.sleep(0.01)
        raise AssertionError(f"no {kind!r} event: {self.events}")

    def all(self) -> list[dict]:
        self._thread.join(600)
        assert not self._thread.is_alive(), "the event stream never ended"
        assert self.error is None, repr(self.error)
        return self.events


def test_a_preempted_batch_job_yields_at_a_step_boundary_and_the_interactive_job_runs_first(
    spawn_role, stack, mooncake_cluster, image, tmp_path
):
    """One transformer: a batch job is held inside its denoising step 1 when an
    interactive job arrives; the orchestrator asks it to yield. The event stream
    says ``preempted`` and then ``yielded`` because the runner did stop (before step
    2, through LightX2V's own ``stop_signal``): the interactive job's denoise starts
    only after the yield and completes first, the batch job then runs again from
    its start; both byte for byte as colocated (before: ``preempted`` was reported,
    the batch job ran to its end and the interactive job waited)."""
    stack.start_orchestrator("--preemption")
    ids = {"enc-0": ("encoder", 1), "tra-0": ("transformer", 1), "dec-0": ("decode", 2)}
    roles = queue_roles(spawn_role, stack, mooncake_cluster, ids)
    client = stack.client
    gate = RoleGate(tmp_path / "gate")
    batch = request(image, 51, save_result_path=str(tmp_path / "batch.mp4"))
    batch.update(gate.ask("req-batch", 1))
    fast = request(image, 52, save_result_path=str(tmp_path / "fast.mp4"))
    batch_events = Follow(client, client.submit(batch, request_id="req-batch", slo_class="batch"))
    assert gate.wait_reached("req-batch")["worker_id"] == "tra-0"
    fast_rid = client.submit(fast, request_id="req-fast", slo_class="interactive")
    fast_events = Follow(client, fast_rid)
    batch_events.wait("preempted")
    gate.release("req-batch")
    events, fast_evs = batch_events.all(), fast_events.all()  # both requests have ended
    st_fast, st_batch = client.status("req-fast"), client.status("req-batch")
    kinds = [(e["kind"], e.get("stage")) for e in events]
    assert st_fast["state"] == "completed" and st_batch["state"] == "completed", str(kinds)
    kinds = [e["kind"] for e in events]
    assert kinds.count("preempted") == 1 and "yielded" in kinds, kinds
    assert kinds.index("yielded") > kinds.index("preempted")

    def at(evs: list[dict], kind: str) -> list[float]:
        return [e["t"] for e in evs if (e["kind"], e.get("stage")) == (kind, "denoise")]

    first = next(e["attempt"] for e in events if e["kind"] == "progress")
    stopped = max(e["t"] for e in events if e["kind"] == "progress" and e["attempt"] == first)
    fast_started, fast_done = at(fast_evs, "dispatched")[0], at(fast_evs, "done")[0]
    resumed = at(events, "dispatched")[1]
    # the interactive denoise started once the batch job's last step had ended (the
    # worker's progress and its Yielded come in this order), and before it resumed
    assert stopped < fast_started < fast_done <= resumed, (events, fast_evs)
    # the yielded attempt stopped at the boundary after its step 2 of 3; the next ran all
    steps = [(e["attempt"], e["step"]) for e in events if e["kind"] == "progress"]
    assert [k for a, k in steps if a == first] == [3333, 6667], steps
    assert [k for a, k in steps if a != first] == [3333, 6667, 10000], steps
    assert decoded(roles["dec-0"], 52) == colocated(roles["colocated"], fast)
    assert decoded(roles["dec-0"], 51) == colocated(roles["colocated"], batch)

"""Queue mode on the real LightX2V: Encoder, two Transformers and a Decoder
(``WanRunner``, configured by their JSON alone) as workers of a real orchestrator
process (with a token), over a real Mooncake master and store host. Requests are
submitted to the orchestrator's HTTP API with the body LightX2V's server takes;
each role runs an item as LightX2V's server worker runs a request.

The role processes and the orchestrator start once for the module (``roles``;
after every test, no store key, publication, pool byte or extra thread is left).
The fault tests hold the work at a known denoising step with the request's
``test_gate`` (``fakes.hold``, in the file protocol of ``tests/gated.py``'s
``Gate``) and inject the fault there; they never race the work. The kill test
runs last: it leaves one Transformer dead."""

from __future__ import annotations

import base64
import json
import time

import pytest
from conftest import ok, request, role_config
from gated import Gate
from servicestack import ServiceStack

from mooncake_diffusion.orchestrator.client import OrchestratorClient

pytestmark = [pytest.mark.engines, pytest.mark.integration, pytest.mark.timeout(3600)]

TOKEN = "s3cret"
ROLES = (("encoder", "enc-0"), ("transformer", "tra-0"), ("transformer", "tra-1"))
ROLES += (("decode", "dec-0"),)
#: hang guard for conditions the tests wait for (never a bound on how fast)
HANG_S = 1800.0


class Queue:
    """The module's orchestrator (``stack``), its client and the role processes."""

    def __init__(self, stack: ServiceStack, client: OrchestratorClient, roles: dict) -> None:
        self.stack, self.client, self.roles = stack, client, roles


def queue_config(cluster, stack: ServiceStack, mode: str, wid: str, token: str = TOKEN) -> dict:
    queue = {"orchestrator": stack.worker_address, "worker_id": wid, "token": token}
    return role_config(mode, cluster, queue={**queue, "result_sha256": True})


def wait_until(what: str, cond, hang_guard: float = HANG_S):
    deadline = time.monotonic() + hang_guard
    while not (got := cond()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return got


def workers(client) -> set[str]:
    return {w["worker_id"] for w in client.cluster()["workers"]}


@pytest.fixture(scope="module")
def q(roles, mooncake_cluster, tmp_path_factory):
    """The orchestrator and the four queue roles (plus a colocated reference),
    started once; the orchestrator stops before the pool releases the roles."""
    stack = ServiceStack(
        tmp_path_factory.mktemp("orch"), mooncake_cluster.settings.as_env(), heartbeat_timeout=5.0
    )
    stack.start_orchestrator("--token", TOKEN)
    client = OrchestratorClient(f"http://127.0.0.1:{stack.api_port}", token=TOKEN)
    specs = {wid: (queue_config(mooncake_cluster, stack, m, wid),) for m, wid in ROLES}
    specs["colocated"] = (role_config(None, mooncake_cluster),)
    started = roles.start(specs)
    wait_until("the queue roles joined", lambda: {w for _, w in ROLES} <= workers(client))
    yield Queue(stack, client, started)
    client.close()
    assert stack.close()["orchestrator"] == 0


def result(st: dict) -> dict:
    assert st["state"] == "completed", st
    return json.loads(base64.b64decode(st["output"]))


def dispatched(st: dict, stage: str) -> list[str]:
    return [
        e["worker_id"] for e in st["events"] if e["kind"] == "dispatched" and e["stage"] == stage
    ]


def colocated(q: Queue, body: dict) -> dict:
    ref = ok(q.roles["colocated"].request(op="run", seed=body["seed"], task=body))
    assert ref["status"] == "success", ref
    return ref["seen"]["vae_decode_input"]


def test_queue_mode_completes_requests_with_progress_on_the_real_runner(q, module_image, tmp_path):
    client = q.client
    for seed in (21, 22):
        body = request(module_image, seed, save_result_path=str(tmp_path / f"q{seed}.mp4"))
        rid = client.submit(body, request_id=f"req-{seed}")
        events = list(client.events(rid))  # follows the stream until the request ends
        st = client.status(rid)
        out = result(st)
        assert out["request_id"] == rid and out["save_result_path"] == body["save_result_path"]
        assert (tmp_path / f"q{seed}.mp4").stat().st_size > 0  # the Decoder saved the video
        progress = [(e["step"], e["total"]) for e in events if e["kind"] == "progress"]
        # three denoising steps: LightX2V reports 33.3.., 66.6.., 100.0 of 100
        assert progress == [(33, 100), (66, 100), (100, 100)], events
        assert all(e["stage"] == "denoise" for e in events if e["kind"] == "progress")
        assert dispatched(st, "encode") == ["enc-0"] and dispatched(st, "decode") == ["dec-0"]
        assert dispatched(st, "denoise")[0] in ("tra-0", "tra-1")
        decoded = ok(q.roles["dec-0"].request(op="info"))["seen"]["vae_decode_input"]
        ref_body = {**body, "save_result_path": str(tmp_path / f"ref{seed}.mp4")}
        assert decoded == colocated(q, ref_body)  # byte for byte as colocated
    # a request's config overrides (as LightX2V's server applies them) end with it
    short = client.submit(request(module_image, 23, target_video_length=5))
    assert result(client.wait(short, timeout=HANG_S))
    assert ok(q.roles["dec-0"].request(op="info"))["seen"]["vae_decode_input"]["shape"] == [
        16,
        2,
        8,
        12,
    ]
    after = client.submit(request(module_image, 24))
    assert result(client.wait(after, timeout=HANG_S))
    decoded = ok(q.roles["dec-0"].request(op="info"))["seen"]["vae_decode_input"]
    assert decoded["shape"] == [16, 3, 8, 12]
    assert decoded == colocated(q, {**request(module_image, 24), "target_video_length": 9})
    # a queue-mode role takes no work from LightX2V's own entry (its server's requests)
    direct = ok(q.roles["tra-0"].request(op="run", seed=1, task=request(module_image, 1)))
    assert direct["status"] == "failed" and "orchestrator" in direct["error"], direct


def test_priorities_come_from_the_orchestrator(q, module_image, tmp_path):
    """Both Transformers are held inside a first request each; a batch request and
    then an interactive one queue behind them. The first Transformer let go takes
    the interactive one, while the batch one still waits."""
    client, gate = q.client, Gate(tmp_path)

    def held(seed: int) -> str:
        rid = f"held-{seed}"
        g = {"dir": str(gate.root), "rid": rid, "step": 1}
        body = request(module_image, seed, test_gate=g)
        return client.submit(body, request_id=rid, slo_class="batch")

    first = [held(50), held(51)]
    holders = [gate.wait_reached(rid) for rid in first]
    assert sorted(holders) == ["tra-0", "tra-1"]  # each Transformer inside one, at step 1
    try:
        batch = client.submit(request(module_image, 52), slo_class="batch")
        urgent = client.submit(request(module_image, 53), slo_class="interactive")
        wait_until(
            "both queued at denoise",
            lambda: set(client.cluster()["queued"].get("denoise", [])) == {batch, urgent},
        )
        gate.release(first[0])
        wait_until(
            "the interactive one at denoise", lambda: dispatched(client.status(urgent), "denoise")
        )
        assert dispatched(client.status(urgent), "denoise") == [holders[0]]
        assert client.cluster()["queued"].get("denoise", []) == [batch]  # still waiting
    finally:
        for rid in first:
            gate.release(rid)
    done = {rid: client.wait(rid, timeout=HANG_S) for rid in (*first, batch, urgent)}
    for st in done.values():  # nothing failed, nothing re-ran
        result(st)
        assert not st.get("reasons") and "requeued" not in [e["kind"] for e in st["events"]]


def test_a_wrong_token_is_refused_at_hello_and_ends_only_the_worker(
    q, roles, mooncake_cluster, module_image
):
    intruder = roles.get(
        "tra-x", queue_config(mooncake_cluster, q.stack, "transformer", "tra-x", "guess")
    )
    info = wait_until(
        "the intruder's worker ended",
        lambda: (i := ok(intruder.request(op="info")))["queue"]["alive"] is False and i,
    )
    assert "refused" in info["queue"]["error"], info
    assert "tra-x" not in workers(q.client)
    assert info["adapter"]  # the role process itself is up and answers
    # the cluster serves on
    rid = q.client.submit(request(module_image, 60))
    st = q.client.wait(rid, timeout=HANG_S)
    result(st)
    assert dispatched(st, "denoise")[0] in ("tra-0", "tra-1")


def test_a_transformer_killed_mid_item_leaves_the_request_to_another(q, module_image, tmp_path):
    client, gate = q.client, Gate(tmp_path)
    rid = "kill-41"
    body = request(module_image, 41, test_gate={"dir": str(gate.root), "rid": rid, "step": 1})
    client.submit(body, request_id=rid)
    victim = gate.wait_reached(rid)  # inside denoising step 1 of rid, held there
    assert victim in ("tra-0", "tra-1")
    q.roles[victim].kill()  # SIGKILL mid-denoise: no goodbye, no cleanup
    gate.release(rid)
    st = client.wait(rid, timeout=HANG_S)
    result(st)
    kinds = [(e["kind"], e.get("stage")) for e in st["events"]]
    assert ("requeued", "denoise") in kinds, kinds
    denoise = dispatched(st, "denoise")
    assert denoise[0] == victim and denoise[-1] not in (victim,), denoise
    decoded = ok(q.roles["dec-0"].request(op="info"))["seen"]["vae_decode_input"]
    assert decoded == colocated(q, {**request(module_image, 41), "target_video_length": 9})
    # and the survivor keeps serving
    assert result(client.wait(client.submit(request(module_image, 42)), timeout=HANG_S))

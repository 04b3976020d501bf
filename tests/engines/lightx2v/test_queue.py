"""Queue mode on the real LightX2V: Encoder, Transformer and Decoder role processes
(``WanRunner``, configured by their JSON alone) as workers of a real orchestrator
process, over a real Mooncake master and store host. Requests are submitted to
the orchestrator's HTTP API with the body LightX2V's server takes; each role
runs an item as LightX2V's server worker runs a request; the Transformer's
``progress_callback(percent_float, 100)`` reaches the request's event stream."""

from __future__ import annotations

import base64
import json
import time

import pytest
from conftest import ok, request, role_config
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
        # three denoising steps: LightX2V reports 33.3.., 66.6.., 100.0 of 100
        assert progress == [(33, 100), (66, 100), (100, 100)], events
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

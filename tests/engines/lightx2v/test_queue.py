"""Queue mode: Encoder, Transformer and Decoder role processes (the stand-in runner,
configured by their JSON alone) as workers of a real orchestrator process, over a
real Mooncake master and store host. Requests are submitted to the orchestrator's
HTTP API; the Decoder's output is the request's result."""

from __future__ import annotations

import base64
import json
import time

import pytest
from conftest import role_config
from lightx2v.models.runners.wan.wan_runner import latent_dims
from servicestack import ServiceStack
from test_roles import expected_latents, ok

from mooncake_diffusion.orchestrator.client import OrchestratorClient

pytestmark = [pytest.mark.engines, pytest.mark.integration]


@pytest.fixture
def stack(tmp_path, spawn_role, mooncake_cluster):
    """An orchestrator process, not started yet (stopped before the roles are
    released and checked)."""
    s = ServiceStack(tmp_path, mooncake_cluster.settings.as_env(), heartbeat_timeout=2.0)
    yield s
    assert s.close()["orchestrator"] == 0


def queue_role(spawn_role, stack, cluster, mode: str, worker_id: str, credits=1, **disagg):
    queue = {"orchestrator": stack.worker_address, "worker_id": worker_id, "result_sha256": True}
    queue["credits"] = credits
    return spawn_role(worker_id, role_config(mode, cluster, queue=queue, **disagg))


def wait_workers(client, ids: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ids <= {w["worker_id"] for w in client.cluster()["workers"]}:
            return
        time.sleep(0.05)
    raise AssertionError(f"workers {ids} never registered: {client.cluster()['workers']}")


def result(st: dict) -> dict:
    assert st["state"] == "completed", st
    return json.loads(base64.b64decode(st["output"]))


def wait_released(cluster, roles, timeout: float = 30) -> None:
    """Until the orchestrator's Release has dropped every payload of finished requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [ok(r.request(op="info"))["live_publications"] for r in roles]
        if not cluster.keys() and not any(live):
            return
        time.sleep(0.1)
    raise AssertionError(f"payloads left: keys {cluster.keys()}, live publications {live}")


@pytest.mark.parametrize("mode", ["auto", "p2p"])
def test_queue_mode_completes_requests_byte_for_byte_as_room_mode(
    spawn_role, stack, mooncake_cluster, mode
):
    seeds = [31, 32, 33]
    stack.start_orchestrator()
    credits = 1 if mode == "auto" else 2  # 2: the next item's input moves during this one
    roles = [
        queue_role(spawn_role, stack, mooncake_cluster, m, wid, credits, transfer_mode=mode)
        for m, wid in (("encoder", "enc-0"), ("transformer", "tra-0"), ("decode", "dec-0"))
    ]
    config = role_config("transformer", mooncake_cluster)
    if mode == "auto":  # room mode, the reference: the same stand-in roles on their rooms
        enc, tra, dec = (
            spawn_role(f"room-{m}", role_config(m, mooncake_cluster, **extra))
            for m, extra in (
                ("encoder", {}),
                ("transformer", {"decoder_engine_rank": 2}),
                ("decode", {}),
            )
        )
        for s in seeds:
            ok(enc.request(op="run", seed=s))
            ok(tra.request(op="run", seed=s))
        room = {s: ok(dec.request(op="run", seed=s))["output"] for s in seeds}
    else:  # what room mode returns (test_roles asserts it, byte for byte)
        room = {s: expected_latents(config, s) for s in seeds}
    client = stack.client
    wait_workers(client, {"enc-0", "tra-0", "dec-0"})
    rids = {s: client.submit({"seed": s}, request_id=f"req-{s}") for s in seeds}  # all queued
    for s, rid in rids.items():
        st = client.wait(rid, timeout=120)
        out = result(st)
        assert out["result"] == {k: room[s][k] for k in ("dtype", "shape", "sha256")}
        assert out["result"]["sha256"] == expected_latents(config, s)["sha256"]
        assert out["result"]["shape"] == list(latent_dims(config))
        assert out["request_id"] == rid
        dispatched = [
            (e["stage"], e["worker_id"]) for e in st["events"] if e["kind"] == "dispatched"
        ]
        assert dispatched == [("encode", "enc-0"), ("denoise", "tra-0"), ("decode", "dec-0")]
    # a request's config overrides (as LightX2V's server applies them) are its own
    short = client.wait(client.submit({"seed": 34, "target_video_length": 9}), timeout=120)
    after = client.wait(client.submit({"seed": 35}), timeout=120)
    expect = expected_latents({**config, "target_video_length": 9}, 34)
    assert result(short)["result"]["sha256"] == expect["sha256"]
    assert result(short)["result"]["shape"] == [16, 3, 8, 12]
    assert result(after)["result"]["sha256"] == expected_latents(config, 35)["sha256"]
    # a queue-mode role takes no work from LightX2V's own entry (a POST to its server)
    direct = roles[1].request(op="run", seed=1)
    assert direct["error"] == "ConfigError" and "orchestrator" in direct["message"], direct
    wait_released(mooncake_cluster, roles)
    assert ok(roles[2].request(op="info"))["pool_bytes_in_use"] == 0


def test_a_transformer_killed_mid_item_leaves_the_request_to_another(
    spawn_role, stack, mooncake_cluster, tmp_path
):
    gate = tmp_path / "go"
    names = [("encoder", "enc-0"), ("transformer", "tra-0"), ("transformer", "tra-1")]
    roles = {wid: queue_role(spawn_role, stack, mooncake_cluster, m, wid) for m, wid in names}
    roles["dec-0"] = queue_role(spawn_role, stack, mooncake_cluster, "decode", "dec-0")
    assert all(ok(r.request(op="info"))["adapter"] for r in roles.values())
    stack.start_orchestrator()  # after the roles: they keep saying Hello until it answers
    client = stack.client
    wait_workers(client, set(roles))
    # the stand-in's DiT holds every request until the gate file exists
    rid = client.submit({"seed": 41, "standin_hold_until": str(gate)})
    deadline = time.monotonic() + 60
    while (st := client.status(rid)).get("stage") != "denoise" or st.get("step", 0) < 1:
        assert st["state"] == "queued" or st["state"] == "running", st
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    victim = st["worker_id"]
    assert victim in ("tra-0", "tra-1")
    roles.pop(victim).kill()  # SIGKILL mid-denoise: no goodbye, no cleanup
    gate.touch()
    out = result(st := client.wait(rid, timeout=120))
    config = role_config("transformer", mooncake_cluster)
    assert out["result"]["sha256"] == expected_latents(config, 41)["sha256"]
    kinds = [(e["kind"], e.get("stage"), e.get("worker_id")) for e in st["events"]]
    assert ("requeued", "denoise", None) in kinds, kinds
    denoise = [w for k, s, w in kinds if k == "dispatched" and s == "denoise"]
    assert denoise[0] == victim and denoise[-1] != victim, denoise
    # and the survivors keep serving
    out = result(client.wait(client.submit({"seed": 42}), timeout=120))
    assert out["result"]["sha256"] == expected_latents(config, 42)["sha256"]
    wait_released(mooncake_cluster, roles.values())


def test_priorities_come_from_the_orchestrator_and_a_wrong_token_is_refused(
    spawn_role, stack, mooncake_cluster, tmp_path
):
    gate, loaded = tmp_path / "go", tmp_path / "loaded"
    stack.start_orchestrator("--token", "s3cret")
    client = OrchestratorClient(f"http://127.0.0.1:{stack.api_port}", token="s3cret")
    good = {"orchestrator": stack.worker_address, "token": "s3cret", "result_sha256": True}
    roles = [
        spawn_role(wid, role_config(m, mooncake_cluster, queue={**good, "worker_id": wid}))
        for m, wid in (("encoder", "enc-0"), ("decode", "dec-0"))
    ]
    # the Transformer's models load (after init_disagg) until `loaded` exists
    tra = role_config("transformer", mooncake_cluster, queue={**good, "worker_id": "tra-0"})
    roles.append(spawn_role("tra-0", {**tra, "standin_load_until": str(loaded)}))
    intruder = spawn_role(
        "tra-x",
        role_config(
            "transformer",
            mooncake_cluster,
            queue={"orchestrator": stack.worker_address, "worker_id": "tra-x", "token": "guess"},
        ),
    )
    try:
        wait_workers(client, {"enc-0", "dec-0"})
        # the one Transformer is held on a first request while two more queue behind it
        first = client.submit({"seed": 50, "standin_hold_until": str(gate)}, slo_class="batch")
        deadline = time.monotonic() + 60
        while first not in client.cluster()["queued"].get("denoise", []):
            assert time.monotonic() < deadline, client.status(first)
            time.sleep(0.05)
        # a role whose models are still loading has not joined: the item waits for it
        assert "tra-0" not in {w["worker_id"] for w in client.cluster()["workers"]}
        loaded.touch()
        while (st := client.status(first))["state"] != "running" or st["stage"] != "denoise":
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        batch = client.submit({"seed": 51}, slo_class="batch")
        urgent = client.submit({"seed": 52}, slo_class="interactive")
        while set(client.cluster()["queued"].get("denoise", [])) != {batch, urgent}:
            assert time.monotonic() < deadline, client.cluster()
            time.sleep(0.05)
        gate.touch()
        done = {rid: client.wait(rid, timeout=120) for rid in (first, batch, urgent)}
        config = role_config("transformer", mooncake_cluster)
        for rid, seed in ((first, 50), (batch, 51), (urgent, 52)):
            assert result(done[rid])["result"]["sha256"] == expected_latents(config, seed)["sha256"]

        def denoise_at(rid: str) -> float:
            return next(
                e["t"]
                for e in done[rid]["events"]
                if e["kind"] == "dispatched" and e["stage"] == "denoise"
            )

        assert denoise_at(urgent) < denoise_at(batch)  # submitted later, served first
        for st in done.values():  # nothing ran before its role was ready, nothing failed
            assert not st.get("reasons") and "requeued" not in [e["kind"] for e in st["events"]]
        # the wrong token: refused at Hello, the worker ends; the role itself stays up
        while (info := ok(intruder.request(op="info")))["queue"]["alive"]:
            assert time.monotonic() < deadline + 60, info
            time.sleep(0.05)
        assert "refused" in info["queue"]["error"], info
        assert "tra-x" not in {w["worker_id"] for w in client.cluster()["workers"]}
        wait_released(mooncake_cluster, roles)
    finally:
        loaded.touch()  # so that teardown can release every role, even after a failure
        gate.touch()
        client.close()

"""vLLM-Omni's built-in SharedMemoryConnector and ours, side by side, across processes.

The cases of vLLM-Omni's own connector tests (``tests/distributed/omni_connectors``
upstream: ``test_shm_connector.py`` and ``test_basic_connectors.py``; the 0.30.0
wheel ships none), each run against both connectors, with the producer in the peer
process (``vo_peer.py``) and the consumer here, as stages run. Where the two
differ on purpose, the test says so and why (``docs/engines.md`` lists them).

Exactly-once takes across processes (four readers of one key) are core's
``Mailbox.take`` and tested there:
``tests/integration/test_keyed_handoff.py::test_mailbox_take_is_exactly_once_across_processes``.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import vo_payloads

pytestmark = pytest.mark.engines

OURS = "MooncakeDiffusionConnector"
SHM = "SharedMemoryConnector"


@pytest.fixture(params=[SHM, OURS])
def pair(request, peer, extra, make):
    """``(connector here, its name, key prefix)``; the peer holds one of the same kind.
    Fails at teardown if a shared-memory segment or lock file of the test is left."""
    name = request.param
    cfg = {} if name == SHM else dict(extra)
    r = peer.request(op="make", name=name, extra=cfg)
    assert r["ok"]
    prefix = f"sbs{uuid.uuid4().hex[:8]}-"
    conn = make(cfg, name=name)
    yield conn, name, prefix
    conn.close()
    assert peer.request(op="close")["ok"]
    left = [f for f in os.listdir("/dev/shm") if prefix in f]
    assert left == [], left


def put(peer, kind, key, seed=0):
    r = peer.request(op="put", kind=kind, key=key, seed=seed, **{"from": "0", "to": "1"})
    assert r["ok"] and r["success"], r
    return r


def test_put_then_get_by_key_consumes_it(pair, peer):
    conn, _, p = pair
    sent = put(peer, "small", f"{p}key_1", seed=42)
    obj, size = conn.get("0", "1", f"{p}key_1")
    assert obj == vo_payloads.build("small", 42) and size == sent["size"]
    assert conn.get("0", "1", f"{p}key_1") is None


def test_missing_key_is_none_at_once(pair):
    conn, _, p = pair
    assert conn.get("0", "1", f"{p}no_such_key") is None
    assert conn.get_with_deadline("0", "1", f"{p}no_such_key", deadline=time.monotonic()) is None


def test_rank_aware_and_hetero_tp_keys_are_independent(pair, peer):
    """Homogeneous TP (rank r -> rank r), then from_tp=2 -> to_tp=1 (one receiver
    reads both senders' keys) and from_tp=1 -> to_tp=2."""
    conn, _, p = pair
    keys = [f"{p}req1_s0_0_{r}_{r}" for r in range(4)]
    keys += [f"{p}req2_s0_0_{s}_0" for s in range(2)] + [f"{p}req3_s0_0_0_{r}" for r in range(2)]
    for seed, key in enumerate(keys):
        put(peer, "small", key, seed=seed)
    for seed, key in reversed(list(enumerate(keys))):  # any order
        obj, _ = conn.get("0", "1", key)
        assert obj["n"] == seed


@pytest.mark.parametrize(
    "metadata",
    [
        {"source_host": "10.0.0.1", "source_port": 12345},  # an RDMA connector's hint
        "not_a_dict",
        {},
        "wrapped",  # {get_key: hint}
    ],
)
def test_metadata_that_is_not_a_handle_falls_back_to_the_key(pair, peer, metadata):
    conn, _, p = pair
    key = f"{p}fb_key"
    put(peer, "small", key, seed=7)
    if metadata == "wrapped":
        metadata = {key: {"source_host": "10.0.0.1", "source_port": 1}}
    obj, _ = conn.get("0", "1", key, metadata=metadata)
    assert obj == vo_payloads.build("small", 7)


def test_a_second_put_to_an_unconsumed_key_overwrites_it(pair, peer):
    """A client request id reused after an abort: the later payload wins, once."""
    conn, _, p = pair
    put(peer, "small", f"{p}again", seed=1)
    second = put(peer, "small", f"{p}again", seed=2)
    obj, size = conn.get("0", "1", f"{p}again")
    assert obj == vo_payloads.build("small", 2) and size == second["size"]
    assert conn.get("0", "1", f"{p}again") is None


def test_falsy_payload_round_trips(pair, peer):
    conn, _, p = pair
    put(peer, "empty", f"{p}falsy_key")
    got = conn.get("0", "1", f"{p}falsy_key")
    assert got is not None and got[0] == {}


def test_cleanup_of_an_exact_key_from_the_other_process(pair, peer):
    conn, _, p = pair
    put(peer, "small", f"{p}cleanup_req_42")
    conn.cleanup(f"{p}cleanup_req_42")
    assert conn.get("0", "1", f"{p}cleanup_req_42") is None


def test_cleanup_by_request_id(pair, peer):
    """Both leave other requests alone, including ids that merely start with this one.
    Difference kept on purpose: ours also removes the request's chunk keys
    ``{id}_{stage}_{chunk}`` (as later vLLM-Omni's own sweep does); 0.30.0's
    shared-memory connector unlinks only the exact key, and since 0.30.0 never calls
    ``cleanup`` on third-party connectors, a caller naming a request means all of it."""
    conn, name, p = pair
    rid = f"{p}c1"
    chunks = [f"{rid}_0_{i}" for i in range(2)]
    others = [f"{rid}__cfg_text", f"{rid}x_0_0", f"{p}other-req_0_0"]
    for key in chunks + others:
        put(peer, "small", key)
    conn.cleanup(rid)
    for key in others:
        assert conn.get("0", "1", key) is not None, key
    left = [key for key in chunks if conn.get("0", "1", key) is not None]
    assert left == (chunks if name == SHM else [])


def test_producer_close(pair, peer, extra, make):
    """Difference kept on purpose: the shared-memory connector unlinks what nobody took
    when its producer closes; in store mode ours leaves it for the consumer (the bytes
    live in the store, not the producer) until taken, cleaned up or expired, so a
    stage that restarts or scales in loses nothing in flight. In p2p mode ours drops
    it too (``test_connector.py``), as its bytes leave with the producer."""
    conn, name, p = pair
    put(peer, "small", f"{p}close_test_0", seed=5)
    assert peer.request(op="close")["ok"]
    got = conn.get("0", "1", f"{p}close_test_0")
    if name == SHM:
        assert got is None
    else:
        assert got is not None and got[0] == vo_payloads.build("small", 5)


def test_the_serializers_types_come_back_as_their_classes(pair, peer):
    """Both rebuild OmniRequestOutput, CompletionOutput, RequestOutput and PIL images.
    Differences kept on purpose, where ours returns what was put: vLLM-Omni's codec
    sends a ``slice`` as a ``(start, stop, step)`` list, and a dataclass by its fields
    only, so a CompletionOutput inside an OmniRequestOutput loses the
    ``multimodal_output`` set on it after construction (kept inside a RequestOutput)."""
    from PIL import Image
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm_omni.outputs import OmniRequestOutput

    conn, name, p = pair
    sent = put(peer, "omni_output", f"{p}types", seed=6)
    obj, _ = conn.get("0", "1", f"{p}types")
    assert type(obj) is OmniRequestOutput and type(obj.outputs[0]) is CompletionOutput
    stage_output = obj._custom_output["stage_output"]
    assert type(stage_output) is RequestOutput
    assert stage_output.outputs[0].multimodal_output["audio"].dtype == torch.bfloat16
    assert [type(i) for i in obj.images] == [Image.Image, Image.Image]
    window = obj._custom_output["window"]
    audio = getattr(obj.outputs[0], "multimodal_output", None)
    if name == SHM:
        assert window == [0, 16, 2] and audio is None
    else:
        assert window == slice(0, 16, 2) and audio["audio"].dtype == torch.bfloat16
        assert vo_payloads.digest(obj) == sent["digest"]


def test_raw_kv_bytes_come_back_as_bytes(pair, peer):
    conn, _, p = pair
    key = f"{p}omni_0_to_1_kv_cache_req-kv"
    put(peer, "kv", key, seed=11)
    got, _ = conn.get("0", "1", key)
    assert type(got) is bytes and got == vo_payloads.build("kv", 11)


def test_get_with_deadline_returns_what_was_put(pair, peer):
    """Ours polls until the deadline; 0.30.0's shared-memory connector looks once (the
    diffusion stage payload loop polls around it). Both return the payload."""
    conn, _, p = pair
    put(peer, "diffusion", f"{p}dit_0_0", seed=3)
    got = conn.get_with_deadline("0", "1", f"{p}dit_0_0", deadline=time.monotonic() + 240)
    assert got is not None and got[0]["height"] == 720


def test_only_ours_expires_what_nobody_takes(peer, extra, make, mooncake_cluster):
    """Difference kept on purpose: nothing of the shared-memory connector expires (a
    segment nobody takes stays in /dev/shm until reboot); ours removes what nobody took
    after ``ttl_s`` (default 600 s, the longest vLLM-Omni waits for an output), with no
    ``cleanup`` or ``close`` call, logged as a warning. Here with a TTL of 0.2 s."""
    r = peer.request(op="make", name=OURS, extra={**extra, "ttl_s": 0.2})
    assert r["ok"]
    conn = make(extra)
    put(peer, "thinker2talker", "ttl-req_0_0", seed=1)
    time.sleep(0.3)  # past the TTL: whether a reaper came by first or not, it is gone
    assert conn.get("0", "1", "ttl-req_0_0") is None
    assert mooncake_cluster.keys() == []

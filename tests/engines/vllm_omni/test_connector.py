"""MooncakeDiffusionConnector against the real vllm-omni 0.30.0 and vllm 0.30.0.

The deploy YAML goes through vLLM-Omni's own loaders, connectors are built by its
own factory after vLLM's plugin loader ran this package's entry point, and data
crosses processes (this one and ``vo_peer.py``) through a real mooncake_master and
store host. Each test ends with no store key left (the ``make`` fixture).
"""

from __future__ import annotations

import gc
import importlib.metadata
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import vo_payloads

from mooncake_diffusion.errors import MasterUnavailableError

pytestmark = pytest.mark.engines

NAME = "MooncakeDiffusionConnector"
HERE = Path(__file__).resolve().parent

DEPLOY_YAML = """
async_chunk: false
connectors:
  mooncake_diffusion:
    name: MooncakeDiffusionConnector
    extra:
      master: "{master}"
      admin: "{admin}"
      host: "127.0.0.1"
      transfer_mode: store
      ttl_s: 120
stages:
  - stage_id: 0
    output_connectors:
      to_stage_1: mooncake_diffusion
  - stage_id: 1
    input_connectors:
      from_stage_0: mooncake_diffusion
"""


def peer_make(peer, extra, **over):
    r = peer.request(op="make", name=NAME, extra={**extra, **over})
    assert r["ok"], r
    assert NAME in r["registered"]


def peer_put(peer, kind, key, seed, frm="0", to="1", **kw):
    r = peer.request(op="put", kind=kind, key=key, seed=seed, **{"from": frm, "to": to}, **kw)
    assert r["ok"] and r["success"], r
    return r


def test_deploy_yaml_parsed_by_vllm_omni_and_connector_built_by_its_factory(
    tmp_path, mooncake_cluster, vllm_omni, extra, make
):
    import mooncake_diffusion_vllm_omni
    from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector
    from vllm_omni.config.stage_config import load_deploy_config
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
    from vllm_omni.distributed.omni_connectors.utils.initialization import (
        get_connectors_config_for_stage,
        load_omni_transfer_config,
        resolve_connector_spec,
    )

    path = tmp_path / "deploy.yaml"
    path.write_text(DEPLOY_YAML.format(master=extra["master"], admin=extra["admin"]))

    deploy = load_deploy_config(path)  # the `vllm serve --omni --deploy-config` loader
    assert deploy.connectors["mooncake_diffusion"]["name"] == NAME
    transfer = load_omni_transfer_config(path)
    spec = transfer.connectors[("0", "1")]
    assert spec.name == NAME and spec.extra["transfer_mode"] == "store"

    # the entry point is what registered the name; registering again changes nothing
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "mooncake_diffusion_vllm_omni.plugin:register" for ep in eps)
    assert vllm_omni.list_registered_connectors().count(NAME) == 1
    mooncake_diffusion_vllm_omni.register()
    assert vllm_omni.list_registered_connectors().count(NAME) == 1

    # the receiver's spec as a stage worker gets it: role, from/to and stage_id injected
    recv = get_connectors_config_for_stage(transfer, 1)["from_stage_0"]["spec"]
    assert recv["extra"]["role"] == "receiver" and recv["extra"]["from_stage"] == 0
    as_receiver = resolve_connector_spec(ConnectorSpec(**recv), stage_id=1, role="receiver")
    receiver = make(as_receiver.extra)
    sender = make(resolve_connector_spec(spec, stage_id=0, role="sender").extra)
    assert isinstance(receiver, MooncakeDiffusionConnector)
    assert receiver.stage_id == 1 and sender.stage_id == 0
    assert receiver.config["role"] == "receiver" and receiver.config["to_stage"] == 1
    assert receiver.supports_raw_data is True
    assert receiver.health()["status"] == "healthy"

    ok, size, _ = sender.put("0", "1", "req-yaml_0_0", {"ids": [1, 2, 3], "text": "hi"})
    assert ok and size > 0
    assert receiver.get("0", "1", "req-yaml_0_0") == ({"ids": [1, 2, 3], "text": "hi"}, size)
    assert receiver.get("0", "1", "req-yaml_0_0") is None  # consumed once


def test_thinker_to_talker_full_payload_across_processes(peer, extra, make):
    peer_make(peer, extra)
    conn = make(extra)
    put = peer_put(peer, "thinker2talker", "req-t2t_0_0", seed=7)
    got = conn.get("0", "1", "req-t2t_0_0")
    assert got is not None
    obj, size = got
    assert size == put["size"]
    assert vo_payloads.digest(obj) == put["digest"]  # every tensor byte, ids and strings
    assert obj["meta"]["finished"].item() is True
    assert obj["ids"]["prompt"] == obj["ids"]["all"][: len(obj["ids"]["prompt"])]
    assert conn.get("0", "1", "req-t2t_0_0") is None


def test_async_chunks_with_incrementing_chunk_id_come_back_as_dicts(peer, extra, make):
    peer_make(peer, {**extra, "stage_id": 0, "role": "sender"})
    conn = make({**extra, "stage_id": 1, "role": "receiver"})
    for chunk_id in range(4):
        last = chunk_id == 3
        put = peer_put(peer, "chunk", f"ext-9_0_{chunk_id}", 9, chunk_id=chunk_id, last=last)
        obj, size = conn.get("0", "1", f"ext-9_0_{chunk_id}")
        assert isinstance(obj, dict)  # msgspec structs are returned as dicts
        assert vo_payloads.digest(obj) == put["digest"] and size == put["size"]
        assert obj["meta"]["chunk_seq"] == chunk_id
        assert bool(obj["meta"]["finished"]) is last


def test_packed_kv_cache_bytes_round_trip_unchanged(peer, extra, make):
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import KVCacheTransferData

    conn = make(extra)
    peer_make(peer, extra)
    key = "omni_0_to_1_kv_cache_req-kv"
    raw = vo_payloads.build("kv", 11)
    ok, size, _ = conn.put("0", "1", key, raw)  # this process produces, the peer consumes
    assert ok and size >= len(raw)
    r = peer.request(op="get", key=key, **{"from": "0", "to": "1"})
    assert r["found"] and r["type"] == "bytes"  # one type for raw bytes, any size
    assert r["digest"] == vo_payloads.expected_digest(raw)
    # and the reverse direction, decoded by vLLM-Omni's own KV unpacker
    peer_put(peer, "kv", key, seed=12)
    got, _ = conn.get("0", "1", key)
    assert type(got) is bytes
    mine = KVCacheTransferData.from_bytes(got)
    theirs = KVCacheTransferData.from_bytes(vo_payloads.build("kv", 12))
    assert mine["request_id"] == theirs["request_id"] == "req-12"
    for a, b in zip(
        mine["layer_blocks"]["key_cache"], theirs["layer_blocks"]["key_cache"], strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_vllm_output_classes_come_back_as_themselves_across_processes(peer, extra, make):
    """What a stage hands the next one (and what Dynamo passes through the connector):
    an ``OmniRequestOutput`` read by attribute, with the classes vLLM-Omni's own codec
    rebuilds (CompletionOutput, RequestOutput, PIL images) rebuilt here too, no pickle."""
    from PIL import Image
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer
    from vllm_omni.outputs import OmniRequestOutput

    peer_make(peer, extra)
    conn = make(extra)
    put = peer_put(peer, "omni_output", "req-types_0_0", seed=4)
    obj, size = conn.get("0", "1", "req-types_0_0")
    assert type(obj) is OmniRequestOutput and size == put["size"]
    assert vo_payloads.digest(obj) == put["digest"]  # every class, attribute and byte
    completion = obj.outputs[0]
    assert type(completion) is CompletionOutput and completion.text == "a cat, seed 4"
    assert completion.multimodal_output["audio"].dtype == torch.bfloat16
    assert [type(i) for i in obj.images] == [Image.Image, Image.Image]
    stage_output = obj._custom_output["stage_output"]
    assert type(stage_output) is RequestOutput and stage_output.outputs[0].finish_reason == "stop"
    assert obj._custom_output["window"] == slice(0, 16, 2)
    # vLLM-Omni's own codec rebuilds the same classes from the same object
    theirs = OmniSerializer.deserialize(
        OmniSerializer.serialize(vo_payloads.build("omni_output", 4))
    )
    assert type(theirs) is OmniRequestOutput and type(theirs.outputs[0]) is CompletionOutput
    assert type(theirs._custom_output["stage_output"]) is RequestOutput
    # and the other direction: this process puts, the peer rebuilds the classes
    ok, size, _ = conn.put("0", "1", "req-types_0_1", vo_payloads.build("omni_output", 5))
    r = peer.request(op="get", key="req-types_0_1", **{"from": "0", "to": "1"})
    assert ok and r["found"] and r["type"] == "OmniRequestOutput" and r["size"] == size
    assert r["digest"] == vo_payloads.expected_digest(vo_payloads.build("omni_output", 5))


def test_diffusion_stage_payload_read_with_get_with_deadline(peer, extra, make):
    peer_make(peer, extra)
    conn = make(extra)
    result: list = []
    reader = threading.Thread(
        target=lambda: result.append(
            conn.get_with_deadline("0", "1", "req-dit_0_0", deadline=time.monotonic() + 240)
        )
    )
    reader.start()  # waiting before the producer has put anything
    put = peer_put(peer, "diffusion", "req-dit_0_0", seed=5)
    reader.join()
    conn.abandon_get("req-dit_0_0")
    assert result[0] is not None
    obj, size = result[0]
    assert vo_payloads.digest(obj) == put["digest"] and size == put["size"]
    assert obj["height"] == 720 and obj["encoder_output"].shape == (1, 256, 4096)


def test_missing_key_returns_none_at_once(extra, make):
    conn = make(extra)
    assert conn.get("0", "1", "never-put_0_0") is None
    assert conn.get_with_deadline("0", "1", "never-put_0_0", deadline=time.monotonic()) is None
    health = conn.health()
    assert health["misses"] == 2 and health["errors"] == 0


def test_cleanup_deletes_unconsumed_payloads_of_a_request(peer, mooncake_cluster, extra, make):
    peer_make(peer, extra)
    conn = make(extra)
    for chunk_id in range(3):  # three chunks of req-a (big enough to leave data objects)
        peer_put(peer, "diffusion", f"req-a_0_{chunk_id}", seed=chunk_id)
    peer_put(peer, "diffusion", "req-ab_0_0", seed=9)  # shares a prefix, not the request
    peer_put(peer, "diffusion", "req-a__cfg_text", seed=8)  # another request, same start
    before = mooncake_cluster.keys()
    assert any("req-a_0_" in k for k in before)
    conn.cleanup("req-a")  # from the consumer side: it never saw these keys
    left = mooncake_cluster.keys()
    assert left and all("req-a_0_" not in k for k in left), left
    assert conn.get("0", "1", "req-a_0_1") is None
    assert conn.get("0", "1", "req-a__cfg_text") is not None  # exact: not a prefix sweep
    assert conn.get("0", "1", "req-ab_0_0") is not None
    conn.cleanup("req-ab_0_0")  # an exact key, already consumed: fine
    assert mooncake_cluster.keys() == []


def test_store_puts_outlive_a_clean_producer_close_p2p_puts_do_not(
    peer, mooncake_cluster, extra, make
):
    """The built-in shared-memory connector unlinks untaken segments at close; in store
    mode ours keeps them for their consumer (the bytes are in the store, not in the
    producer) until taken, cleaned up or expired: kept on purpose, so a stage that
    restarts or scales down loses nothing in flight."""
    peer_make(peer, extra)
    conn = make(extra)
    put = peer_put(peer, "thinker2talker", "req-c_0_0", seed=3)
    assert peer.request(op="close")["ok"]
    obj, size = conn.get("0", "1", "req-c_0_0")
    assert vo_payloads.digest(obj) == put["digest"] and size == put["size"]
    peer_make(peer, extra, transfer_mode="p2p")
    peer_put(peer, "thinker2talker", "req-c_0_1", seed=4)
    assert peer.request(op="close")["ok"]  # p2p: the bytes leave with the producer
    assert mooncake_cluster.keys() == []
    assert conn.get("0", "1", "req-c_0_1") is None


def test_reap_consumed_forgets_taken_keys(peer, extra, make):
    peer_make(peer, extra)
    conn = make(extra)
    for i in range(3):
        peer_put(peer, "chunk", f"req-r_0_{i}", 1, chunk_id=i, last=i == 2)
    assert peer.request(op="health")["health"]["pending"] == 3
    for i in range(3):
        assert conn.get("0", "1", f"req-r_0_{i}") is not None
    assert peer.request(op="reap")["ok"]
    assert peer.request(op="health")["health"]["pending"] == 0


def test_p2p_mode_across_processes(peer, extra, make):
    peer_make(peer, extra, transfer_mode="p2p")
    conn = make({**extra, "transfer_mode": "p2p"})
    put = peer_put(peer, "latent", "req-p_0_0", seed=2, mb=16)
    obj, size = conn.get("0", "1", "req-p_0_0")
    assert vo_payloads.digest(obj) == put["digest"] and size == put["size"]
    assert peer.request(op="health")["health"]["errors"] == 0


def test_injected_and_unknown_extra_keys_are_accepted(extra, make, vllm_omni):
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    injected = {
        **extra,
        "stage_id": 2,
        "role": "receiver",
        "from_stage": 1,
        "to_stage": 2,
        "type": NAME,
        "codec_chunk_frames": 25,
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "segment": 512_000_000,
        "localbuf": 64_000_000,
        "zmq_port": 50051,
        "something_new": True,
    }
    conn = make(injected)
    assert conn.stage_id == 2 and conn.config["codec_chunk_frames"] == 25
    with pytest.raises(ValueError, match="transfer_mode"):
        vllm_omni.create_connector(ConnectorSpec(name=NAME, extra={**extra, "transfer_mode": "x"}))
    # an unset $VAR fails construction at once, naming it (not later, as a host name)
    unset = {**extra, "host": "$RV_UNSET_HOST"}
    with pytest.raises(ValueError, match="environment variable RV_UNSET_HOST is not set"):
        vllm_omni.create_connector(ConnectorSpec(name=NAME, extra=unset))


def test_core_environment_settings_apply_and_a_bad_receive_device_fails_at_once(monkeypatch):
    """Core's ``MOONCAKE_DIFFUSION_*`` variables (documented for every process) reach
    the connector's settings: they were dropped, the connector building its settings
    from ``extra`` alone. A ``receive_device`` typo fails at construction; it was
    accepted, and every receive then consumed its payload and failed."""
    from mooncake_diffusion_vllm_omni.config import ConnectorConfig

    from mooncake_diffusion.errors import ConfigError

    monkeypatch.setenv("MOONCAKE_DIFFUSION_PEER_TIMEOUT_S", "3")
    monkeypatch.setenv("MOONCAKE_DIFFUSION_GPU_PATH", "staged")
    monkeypatch.setenv("MOONCAKE_DIFFUSION_SAME_HOST", "0")
    cfg = ConnectorConfig.from_extra({"master": "10.0.0.1:50051", "receive_device": "cuda:1"})
    s = cfg.settings
    assert (s.master, s.peer_timeout_s, s.gpu_path, s.same_host) == (
        "10.0.0.1:50051",
        3.0,
        "staged",
        False,
    )
    assert cfg.receive_device == "cuda:1"  # named, not opened: no GPU needed to parse it
    with pytest.raises(ConfigError, match="receive_device"):
        ConnectorConfig.from_extra({"receive_device": "cuda0"})
    monkeypatch.setenv("MOONCAKE_DIFFUSION_PEER_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="MOONCAKE_DIFFUSION_PEER_TIMEOUT_S"):
        ConnectorConfig.from_extra({})


def test_dead_master_fails_construction_clearly(vllm_omni, make):
    from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = {"master": f"127.0.0.1:{port}", "connect_timeout_s": 1}
    with pytest.raises(ValueError, match=f"127.0.0.1:{port}"):
        vllm_omni.create_connector(ConnectorSpec(name=NAME, extra=dead))
    unraisable: list = []
    old, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(MasterUnavailableError):
            MooncakeDiffusionConnector(dead)
        gc.collect()  # __del__ -> close() on the half-built connector must not raise
    finally:
        sys.unraisablehook = old
    assert unraisable == []


def test_a_stage_killed_mid_get_leaves_its_input_to_a_retry(mooncake_cluster, extra, make):
    """A consumer stage process (its own connector, built by vLLM-Omni's factory) claims
    a 64 MiB payload and is SIGKILLed there, before any byte was read: its claim is a
    lease, so a retry gets every byte once the lease lapsed (``timeout_s`` + 5 s), not
    ``None``; nothing is left behind."""
    from mooncake_diffusion.platform.childproc import JsonLinesChild

    producer, retry = make(extra), make({**extra, "timeout_s": 5})
    sent = torch.randn(16 << 20)
    assert producer.put("0", "1", "req-kill_0_0", {"latent": sent})[0]
    child = JsonLinesChild(
        [sys.executable, str(HERE / "vo_peer.py")], mooncake_cluster.settings, "doomed stage"
    )
    try:
        assert child.request(op="ready")["ok"]
        peer_make(child, extra, timeout_s=5)
        assert child.request(op="hold_get", key="req-kill_0_0", **{"from": "0", "to": "1"})["ok"]
        assert retry.get("0", "1", "req-kill_0_0") is None  # a live reader holds it
    finally:
        child.kill()
        child.close()
    got = retry.get_with_deadline("0", "1", "req-kill_0_0", deadline=time.monotonic() + 120)
    assert got is not None, "the input of a stage killed mid-get was lost"
    assert torch.equal(got[0]["latent"], sent)


def test_numpy_zero_d_and_string_arrays_round_trip(extra, make):
    """What the built-in SharedMemoryConnector carries: a 0-d array keeps shape (), and
    unicode / bytes arrays come back equal instead of failing the get."""
    import numpy as np

    producer, consumer = make(extra), make(extra)
    arrays = {"zero_d": np.array(2.5), "text": np.array(["a", "bc"]), "raw": np.array([b"x"])}
    assert producer.put("0", "1", "req-np_0_0", arrays)[0]
    got, _ = consumer.get("0", "1", "req-np_0_0")
    for name, a in arrays.items():
        assert (got[name].dtype, got[name].shape) == (a.dtype, a.shape), name
        assert np.array_equal(got[name], a), name
    assert consumer.health()["errors"] == 0


def test_last_error_is_cleared_by_a_later_success(extra, make):
    conn = make(extra)
    ok, _, _ = conn.put("0", "1", "req-bad_0_0", {"x": object()})  # cannot travel
    assert not ok and "PayloadError" in conn.health()["last_error"]
    assert conn.put("0", "1", "req-good_0_0", {"x": 1})[0]
    assert conn.health()["last_error"] == ""
    assert conn.get("0", "1", "req-good_0_0") is not None

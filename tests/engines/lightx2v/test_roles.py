"""Encoder, Transformer and Decoder as three processes of the stand-in runner,
selected by their role JSON alone, moving real bytes through a real Mooncake
master and store host. Every byte is compared by SHA-256 against what the
encoder computed and what the transformer computed from what it received."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import role_config
from lightx2v.models.runners.wan.wan_runner import WanRunner, latent_dims
from role_worker import InputInfo, describe

pytestmark = [pytest.mark.engines, pytest.mark.integration]


def expected_latents(config: dict, seed: int) -> dict:
    """What the decoder must return for ``seed``: the stand-in's fake DiT run on
    the encoder's outputs, cast to LightX2V's working dtype (bf16) as Phase 2 does."""
    runner = WanRunner({"model_cls": "wan2.1", "task": "i2v", **config})
    runner.input_info = InputInfo(seed, list(latent_dims(config)))
    runner.inputs = runner.run_input_encoder()
    return describe(runner.run_segment(0).to(torch.bfloat16))


def three_roles(spawn_role, cluster, **disagg):
    enc = spawn_role("encoder", role_config("encoder", cluster, **disagg))
    tra = spawn_role(
        "transformer",
        role_config("transformer", cluster, decoder_engine_rank=2, **disagg),
    )
    dec = spawn_role("decode", role_config("decode", cluster, **disagg))
    return enc, tra, dec


def ok(reply: dict) -> dict:
    assert reply.get("ok"), reply
    return reply


@pytest.mark.parametrize("mode", ["p2p", "store", "auto"])
def test_requests_in_flight_on_one_room_arrive_in_order_byte_for_byte(
    spawn_role, mooncake_cluster, mode
):
    enc, tra, dec = three_roles(spawn_role, mooncake_cluster, transfer_mode=mode)
    for role in (enc, tra, dec):
        info = ok(role.request(op="info"))
        assert info["adapter"] and info["builtin_calls"] == []
        assert info["settings"] == [mooncake_cluster.settings.master, mode]
        assert len(info["patched"]) == 6
    assert ok(tra.request(op="info"))["p2_sender"] == "<mooncake_diffusion Phase 2 sender>"
    seeds = [11, 12, 13]
    sent = [ok(enc.request(op="run", seed=s)) for s in seeds]  # 3 in flight, none received
    for s, e in zip(seeds, sent, strict=True):
        got = ok(tra.request(op="run", seed=s))
        assert got["inputs"]["latent_shape"] == e["latent_shape"]
        assert got["inputs"]["text_encoder_output"] == e["inputs"]["text_encoder_output"]
        assert got["inputs"]["image_encoder_output"] == e["inputs"]["image_encoder_output"]
        assert got["output"] is None  # latents went to the decoder
    config = role_config("transformer", mooncake_cluster)
    for s in seeds:
        out = ok(dec.request(op="run", seed=s))
        assert out["output"] == expected_latents(config, s)
        assert out["p2_meta"]["latents_shape"] == list(latent_dims(config))
        assert out["p2_meta"]["latents_dtype"] == "torch.bfloat16"
    assert ok(enc.request(op="info"))["live_publications"] == 0
    info = ok(dec.request(op="info"))
    assert info["pool_bytes_in_use"] == 0
    # the mode in the JSON is the path the bytes took (p2p: same host, so one memory copy)
    path = "store" if mode == "store" else "p2p/shm"
    z, t, h, w = latent_dims(config)
    assert info["last_received"] == {"path": path, "num_chunks": 4, "nbytes": z * t * h * w * 2}
    phase1 = ok(tra.request(op="info"))["last_received"]
    assert phase1["path"] == path and phase1["num_chunks"] == 1


def test_receivers_wait_for_late_senders_and_chunked_latents_verify(spawn_role, mooncake_cluster):
    enc, tra, dec = three_roles(
        spawn_role, mooncake_cluster, latent_chunks=3, verify=True, transfer_mode="store"
    )
    replies: dict[str, dict] = {}

    def run(name, role):
        replies[name] = role.request(op="run", seed=5)

    waiters = [threading.Thread(target=run, args=a) for a in (("dec", dec), ("tra", tra))]
    for t in waiters:  # decoder and transformer block on their receive first
        t.start()
    ok(enc.request(op="run", seed=5))
    for t in waiters:
        t.join(120)
    config = role_config("transformer", mooncake_cluster)
    assert ok(replies["dec"])["output"] == expected_latents(config, 5)
    assert "crc32" in replies["dec"]["p2_meta"]
    assert ok(dec.request(op="info"))["last_received"]["num_chunks"] == 3


def test_full_wan_480p_phase1_geometry(spawn_role, mooncake_cluster):
    wan480 = {
        "text_len": 512,
        "text_encoder_dim": 4096,
        "target_video_length": 81,
        "target_height": 480,
        "target_width": 832,
        "enable_cfg": True,
    }
    enc = spawn_role("encoder", {**role_config("encoder", mooncake_cluster), **wan480})
    tra = spawn_role("transformer", {**role_config("transformer", mooncake_cluster), **wan480})
    e = ok(enc.request(op="run", seed=1))
    got = ok(tra.request(op="run", seed=1))
    text, image = got["inputs"]["text_encoder_output"], got["inputs"]["image_encoder_output"]
    assert text == e["inputs"]["text_encoder_output"]
    assert image == e["inputs"]["image_encoder_output"]
    assert (
        text["context"]["shape"] == [1, 512, 4096] and text["context"]["dtype"] == "torch.bfloat16"
    )
    assert image["vae_encoder_out"]["shape"] == [20, 21, 60, 104]
    assert image["clip_encoder_out"]["shape"] == [257, 1280]
    assert got["output"]["shape"] == [16, 21, 60, 104]  # no decoder: decoded in place


def test_a_receive_with_nothing_sent_times_out_and_the_channel_still_works(
    spawn_role, mooncake_cluster
):
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster))
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster, timeout_s=0.5))
    late = tra.request(op="run", seed=3)
    assert late == {"ok": False, "error": "DeadlineExceededError", "message": late["message"]}
    assert "room 0" in late["message"]
    e = ok(enc.request(op="run", seed=3))
    got = ok(tra.request(op="run", seed=3))
    assert got["inputs"]["text_encoder_output"] == e["inputs"]["text_encoder_output"]


def test_rooms_are_separate_channels(spawn_role, mooncake_cluster):
    pairs = []
    for room in (0, 7):
        enc = spawn_role(
            f"enc{room}", role_config("encoder", mooncake_cluster, bootstrap_room=room)
        )
        tra = spawn_role(
            f"tra{room}", role_config("transformer", mooncake_cluster, bootstrap_room=room)
        )
        pairs.append((enc, tra))
    sent = [ok(enc.request(op="run", seed=100 + i)) for i, (enc, _) in enumerate(pairs)]
    for (_, tra), e in reversed(list(zip(pairs, sent, strict=True))):
        got = ok(tra.request(op="run", seed=0))
        assert got["inputs"]["text_encoder_output"] == e["inputs"]["text_encoder_output"]


def test_another_backend_in_the_json_leaves_the_role_to_lightx2v(spawn_role, mooncake_cluster):
    config = role_config("transformer", mooncake_cluster, decoder_engine_rank=2)
    config["disagg_config"]["transfer_backend"] = "mooncake"
    role = spawn_role("transformer", config)
    info = ok(role.request(op="info"))
    assert not info["adapter"]
    assert info["builtin_calls"] == ["init_disagg"]
    assert info["p2_sender"] == repr("builtin Phase 2 sender")
    assert len(info["patched"]) == 6  # the plugin is loaded; it just does not take this role
    assert ok(role.request(op="release"))["builtin_calls"] == ["init_disagg", "release_disagg"]


def test_a_dead_master_in_the_json_fails_the_role_at_start(spawn_role, mooncake_cluster):
    config = role_config("encoder", mooncake_cluster)
    config["disagg_config"].update(master="127.0.0.1:1", admin="127.0.0.1:2")
    role = spawn_role("encoder", config)
    with pytest.raises(Exception, match="exited with code 1"):
        role.request(op="info")


def test_store_payloads_outlive_their_sender(spawn_role, mooncake_cluster):
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, transfer_mode="store"))
    sent = ok(enc.request(op="run", seed=4))
    ok(enc.request(op="release"))
    enc.close()  # the encoder is gone; its payload is in the store host
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster))
    got = ok(tra.request(op="run", seed=4))
    assert got["inputs"]["text_encoder_output"] == sent["inputs"]["text_encoder_output"]
    assert got["inputs"]["image_encoder_output"] == sent["inputs"]["image_encoder_output"]


def test_a_killed_p2p_sender_fails_the_receive_instead_of_hanging(spawn_role, mooncake_cluster):
    enc = spawn_role("encoder", role_config("encoder", mooncake_cluster, transfer_mode="p2p"))
    tra = spawn_role("transformer", role_config("transformer", mooncake_cluster, timeout_s=5))
    ok(enc.request(op="run", seed=8))
    enc.kill()  # SIGKILL: no release, no exit hook; its handle is still in the mailbox
    lost = tra.request(op="run", seed=8)
    assert not lost["ok"] and lost["error"] in ("PeerGoneError", "TransferError"), lost
    info = ok(tra.request(op="info"))
    assert info["adapter"] and info["pool_bytes_in_use"] == 0

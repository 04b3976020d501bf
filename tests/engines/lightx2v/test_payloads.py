"""LightX2V's dicts <-> named tensors (payloads.py) and disagg_config parsing
(config.py): pure logic, in this process."""

from __future__ import annotations

import pytest
import torch
from mooncake_diffusion_lightx2v import payloads
from mooncake_diffusion_lightx2v.config import AdapterConfig, selects_adapter

from mooncake_diffusion.errors import ConfigError, PayloadError

pytestmark = [pytest.mark.engines, pytest.mark.unit]

BF16 = torch.bfloat16


def wan_inputs(cfg: bool = True, image: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    text = {"context": torch.randn(1, 8, 4, generator=g).to(BF16)}
    text["context_null"] = torch.randn(1, 8, 4, generator=g).to(BF16) if cfg else None
    out = {"text_encoder_output": text, "image_encoder_output": None}
    if image:
        out["image_encoder_output"] = {
            "clip_encoder_out": torch.randn(257, 16, generator=g).to(BF16),
            "vae_encoder_out": torch.randn(20, 2, 3, 5, generator=g).to(BF16),
        }
    return out


def roundtrip(config: dict, inputs: dict, latent_shape: list[int]) -> dict:
    tensors, meta = payloads.pack_phase1(config, inputs, latent_shape, BF16)
    return payloads.unpack_phase1(config, tensors, meta, BF16, "cpu")


def test_wan_i2v_keeps_lightx2v_keys_shapes_and_bytes():
    config = {"model_cls": "wan2.1", "task": "i2v", "enable_cfg": True}
    inputs = wan_inputs()
    got = roundtrip(config, inputs, [16, 2, 3, 5])
    assert set(got) == {"text_encoder_output", "image_encoder_output", "latent_shape"}
    assert got["latent_shape"] == [16, 2, 3, 5]
    for part in ("text_encoder_output", "image_encoder_output"):
        assert set(got[part]) == set(inputs[part])
        for k, v in inputs[part].items():
            assert torch.equal(got[part][k], v) and got[part][k].dtype == BF16
            assert got[part][k].data_ptr() != v.data_ptr()  # a copy on AI_DEVICE


def test_context_null_moves_only_with_cfg_like_lightx2v():
    config = {"model_cls": "wan2.1", "task": "t2v", "enable_cfg": False}
    tensors, meta = payloads.pack_phase1(config, wan_inputs(), [16, 2, 3, 5], BF16)
    assert set(tensors) == {"context"}  # t2v: no image tensors; no cfg: no context_null
    got = payloads.unpack_phase1(config, tensors, meta, BF16, "cpu")
    assert got["text_encoder_output"]["context_null"] is None
    assert got["image_encoder_output"] is None


def test_float_tensors_travel_in_the_working_dtype_and_no_padding():
    config = {"model_cls": "wan2.1", "task": "i2v"}
    inputs = wan_inputs(cfg=False)
    inputs["text_encoder_output"]["context"] = torch.ones(1, 8, 4, dtype=torch.float32)
    tensors, _ = payloads.pack_phase1(config, inputs, [16, 2, 3, 5], BF16)
    assert tensors["context"].dtype == BF16  # LightX2V writes GET_DTYPE() views
    assert tensors["vae_encoder_out"].shape == (20, 2, 3, 5)  # the real shape, not fp32 slots
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nbytes == (8 * 4 + 257 * 16 + 20 * 2 * 3 * 5) * 2


def test_qwen_names_and_image_info_survive():
    config = {"model_cls": "qwen_image", "task": "i2i", "enable_cfg": True}
    emb = torch.randn(1, 6, 4).to(BF16)
    info = {"image_shapes": [torch.tensor([1, 2, 3])], "vae_image_list": [object()], "n": 2}
    inputs = {
        "text_encoder_output": {
            "prompt_embeds": emb,
            "negative_prompt_embeds": emb + 1,
            "image_info": info,
        },
        "image_encoder_output": [{"image_latents": torch.randn(1, 16, 4).to(BF16)}],
    }
    got = roundtrip(config, inputs, [1, 16, 4])
    text = got["text_encoder_output"]
    assert set(text) == {"prompt_embeds", "negative_prompt_embeds", "image_info"}
    assert text["image_info"] == {"image_shapes": [[1, 2, 3]], "n": 2}
    assert torch.equal(text["negative_prompt_embeds"], emb + 1)
    latents = inputs["image_encoder_output"][0]["image_latents"]
    assert torch.equal(got["image_encoder_output"][0]["image_latents"], latents)


def test_missing_image_outputs_arrive_as_lightx2v_zeros():
    config = {"model_cls": "wan2.1", "task": "i2v", "clip_embed_dim": 12}
    inputs = {"text_encoder_output": {"context": torch.ones(1, 2, 2).to(BF16)}}
    got = roundtrip(config, inputs, [16, 2, 3, 5])["image_encoder_output"]
    assert torch.equal(got["clip_encoder_out"], torch.zeros(12, dtype=BF16))
    assert torch.equal(got["vae_encoder_out"], torch.zeros(20, 2, 3, 5, dtype=BF16))


def test_no_context_is_refused():
    with pytest.raises(PayloadError, match="context"):
        payloads.pack_phase1({"task": "t2v"}, {"text_encoder_output": {}}, [1], BF16)


def test_checksum_catches_a_flipped_byte():
    t = torch.randn(3, 5).to(BF16)
    sums = payloads.checksums({"latents": t})
    payloads.verify({"latents": t.clone()}, sums)
    bad = t.clone()
    bad.view(-1).view(torch.uint8)[7] ^= 1
    with pytest.raises(ValueError, match="latents checksum mismatch"):
        payloads.verify({"latents": bad}, sums)


def test_phase2_meta_uses_lightx2v_names():
    class Info:
        auto_height, auto_width = 480, 832

    latents = payloads.pack_phase2(torch.zeros(16, 2, 3, 5), BF16)
    assert latents.dtype == BF16
    assert payloads.phase2_meta(latents, Info()) == {
        "version": 1,
        "latents_shape": [16, 2, 3, 5],
        "latents_dtype": "torch.bfloat16",
        "auto_height": 480,
        "auto_width": 832,
    }


def cfg(mode: str = "encoder", **disagg) -> dict:
    base = {"transfer_backend": "mooncake_diffusion", "master": "10.0.0.1:50051"}
    return {"disagg_mode": mode, "disagg_config": {**base, **disagg}}


def test_selection_is_by_transfer_backend_only():
    assert selects_adapter(cfg())
    assert not selects_adapter({"disagg_config": {"transfer_backend": "mooncake"}})
    assert not selects_adapter({"disagg_mode": "encoder"})
    assert not selects_adapter(None)


def test_disagg_config_keys_become_settings_and_defaults():
    c = AdapterConfig.from_runner_config(
        cfg("transformer", local_hostname="10.0.0.2", protocol="rdma", device_name="mlx5_0")
    )
    assert c.settings.master == "10.0.0.1:50051" and c.settings.admin_address == "10.0.0.1:9003"
    assert (c.settings.local_hostname, c.settings.protocol) == ("10.0.0.2", "rdma")
    assert c.settings.device == "mlx5_0"
    assert (c.connector_role, c.transfer_mode, c.channel) == ("denoise", "auto", "lightx2v")
    assert (c.latent_chunks, c.verify, c.sends_phase2) == (4, False, False)
    assert AdapterConfig.from_runner_config(cfg("transformer", decoder_engine_rank=2)).sends_phase2
    assert c.queue is None


def test_the_queue_key_selects_queue_mode_and_implies_a_decoder():
    q = {"orchestrator": "tcp://10.0.0.1:7422", "credits": 2, "token": "t", "labels": {"z": "a"}}
    c = AdapterConfig.from_runner_config(cfg("transformer", queue=q))
    assert c.sends_phase2 and c.connector_role == "denoise"
    assert c.queue is not None
    assert (c.queue.orchestrator, c.queue.credits, c.queue.token) == ("tcp://10.0.0.1:7422", 2, "t")
    assert (c.queue.labels, c.queue.worker_id, c.queue.result_sha256) == ({"z": "a"}, None, False)


def test_rooms_follow_lightx2v_defaults_and_overrides():
    assert AdapterConfig.room(cfg("encoder"), 1) == 0
    assert AdapterConfig.room(cfg("decode"), 2) == 1
    assert AdapterConfig.room(cfg("transformer", decoder_bootstrap_room=5), 2) == 5
    assert (
        AdapterConfig.room({**cfg("encoder", bootstrap_room=2), "data_bootstrap_room": 9}, 1) == 9
    )
    # a request that sends a room as JSON null names none (LightX2V's own reading skips
    # None; int(None) failed every such request)
    assert (
        AdapterConfig.room({**cfg("encoder", bootstrap_room=2), "data_bootstrap_room": None}, 1)
        == 2
    )
    assert AdapterConfig.room(cfg("transformer", decoder_bootstrap_room=None), 2) == 1
    assert AdapterConfig.room(cfg("decode", bootstrap_room=None), 2) == 1


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (cfg(transfer_mode="rdma"), "transfer_mode"),
        (cfg(latent_chunks=0), "latent_chunks"),
        (cfg(timeout_s="soon"), "timeout_s"),
        (cfg(verify="sha256"), "verify"),
        (cfg(channel="a/b"), "channel"),
        (cfg(decentralized_queue=True), r"queue mode.*\"queue\": \{\"orchestrator\""),
        (cfg(queue="tcp://127.0.0.1:7422"), "queue must be an object"),
        (cfg(queue={"orchestrator": "127.0.0.1:7422"}), r"queue\.orchestrator"),
        (cfg(queue={"orchestrator": "tcp://h:1", "credits": 0}), r"queue\.credits"),
        (cfg(queue={"orchestrator": "tcp://h:1", "credit": 2}), r"unknown keys \['credit'\]"),
        (cfg(queue={"orchestrator": "tcp://h:1", "labels": {"a": 1}}), r"queue\.labels"),
        (cfg("controller"), "disagg_mode"),
        (cfg(master="nowhere"), "master"),
        # JSON values of the wrong type are refused, not read as Python would
        (cfg(same_host="false"), "same_host must be true or false"),
        (cfg(latent_chunks=2.7), "latent_chunks must be a int"),
        (cfg(latent_chunks=True), "latent_chunks must be a int"),
        (cfg(queue={"orchestrator": "tcp://h:1", "result_sha256": "false"}), "result_sha256"),
    ],
)
def test_bad_disagg_config_fails_naming_the_key(config, match):
    with pytest.raises(ConfigError, match=match):
        AdapterConfig.from_runner_config(config)


def test_booleans_and_whole_numbers_are_read_as_given():
    c = AdapterConfig.from_runner_config(cfg(same_host=False, latent_chunks=8.0))
    assert c.settings.same_host is False and c.latent_chunks == 8
    q = {"orchestrator": "tcp://h:1", "result_sha256": True}
    assert AdapterConfig.from_runner_config(cfg("decode", queue=q)).queue.result_sha256 is True


@pytest.mark.parametrize(
    "meta",
    [
        None,
        {"version": 2, "latent_shape": [16, 1, 2, 2]},
        {"version": 1, "latent_shape": None},
        {"version": 1, "latent_shape": [16, -1, 2, 2]},
        {"version": 1, "latent_shape": [16, 1, 2, 2], "zeros": "clip_encoder_out"},
        {"version": 1, "latent_shape": [16, 1, 2, 2], "zeros": ["junk"]},
        {"version": 1, "latent_shape": [16, 1, 2, 2], "task": ["i2v"]},
    ],
)
def test_a_malformed_phase1_meta_is_a_payload_error(meta):
    """Found by fuzzing (tests/chaos/fuzz.py): such metas raised KeyError, TypeError,
    IndexError or RuntimeError from deep inside the unpacking."""
    tensors = {"context": torch.zeros(2, 3)}
    with pytest.raises(PayloadError, match="Phase 1 payload"):
        payloads.unpack_phase1({"task": "i2v"}, tensors, meta, torch.float32, "cpu")
    with pytest.raises(PayloadError, match="crc32"):
        payloads.verify(tensors, [1, 2])

"""``QwenImageRunner`` (Qwen-Image T2I) on the real LightX2V: Encoder, Transformer
and Decoder role processes driven through LightX2V's own server worker
(``TorchrunInferenceWorker.process_request``), plus LightX2V's colocated pipeline
as the reference, over a real Mooncake master and store host.

What cannot run on CPU here, and what replaces it (``fakes.py``): the Qwen2.5-VL
text encoder and the ``QwenImageTransformerModel`` (their weights are 7B and
20B parameters, and the DiT's attention kernels need CUDA) are tiny
deterministic stand-ins installed over the runner's model loaders; the VAE's
network is a tiny stand-in inside LightX2V's own ``AutoencoderKLQwenImageVAE``
wrapper (its ``load``); the test CPU platform (``cpu_platform/``) adds the
``torch.cpu`` memory calls LightX2V makes. Everything else is LightX2V's own:
``QwenImageRunner`` and its ``set_config`` -> ``apply_disagg_request_overrides``,
the ``QwenImageScheduler`` (diffusers' flow-match scheduler), latent packing,
rotary embeddings, the DisaggMixin role flows and saving the PNG.

Qwen's ``set_config`` rewrites ``bootstrap_room`` per request from the request's
``disagg_bootstrap_room`` / ``disagg_decoder_bootstrap_room``: two requests in
flight at once on their own rooms, taken in the opposite order from the one
they were sent in, each get their own bytes."""

from __future__ import annotations

import pytest
from conftest import ok, qwen_config

pytestmark = [pytest.mark.engines, pytest.mark.integration, pytest.mark.timeout(3600)]

QWEN = ("t2i", "qwen_image")


@pytest.fixture(scope="module")
def qwen(roles, mooncake_cluster):
    """Store mode: a send returns once its payload is in the store host, so one
    Encoder can have several requests in flight before any is received."""
    c = mooncake_cluster
    return roles.start(
        {
            "q-enc": (qwen_config("encoder", c, transfer_mode="store"), *QWEN),
            "q-tra": (
                qwen_config("transformer", c, decoder_engine_rank=2, transfer_mode="store"),
                *QWEN,
            ),
            "q-dec": (qwen_config("decode", c, transfer_mode="store"), *QWEN),
            "q-local": (qwen_config(None, c), *QWEN),
        }
    )


def run(role, body: dict) -> dict:
    reply = ok(role.request(op="run", seed=body["seed"], task=body))
    assert reply["status"] == "success", reply
    return reply


def test_two_requests_in_flight_on_their_own_rooms_get_their_own_bytes(qwen, tmp_path):
    enc, tra, dec, local = (qwen[n] for n in ("q-enc", "q-tra", "q-dec", "q-local"))
    info = ok(enc.request(op="info"))
    assert (info["runner"], info["adapter"], info["ai_device"]) == ("QwenImageRunner", True, "cpu")
    # (prompt, seed, Phase 1 room, Phase 2 room) per request
    reqs = {"a": ("a lighthouse at dusk", 5, 40, 50), "b": ("two cats on a red sofa", 6, 41, 51)}

    def body(name: str, role: str) -> dict:
        prompt, seed, p1, p2 = reqs[name]
        out = {
            "prompt": prompt,
            "seed": seed,
            "save_result_path": str(tmp_path / f"{role}-{name}.png"),
        }
        if role in ("enc", "tra"):
            out["disagg_bootstrap_room"] = p1  # Qwen's set_config -> bootstrap_room
        if role == "tra":
            out["disagg_decoder_bootstrap_room"] = p2
        if role == "dec":
            out["disagg_bootstrap_room"] = p2  # the Decoder receives Phase 2 on its room
        return out

    sent = {n: run(enc, body(n, "enc")) for n in ("a", "b")}  # both in flight now
    denoised = {n: run(tra, body(n, "tra")) for n in ("b", "a")}  # taken in reverse
    decoded = {n: run(dec, body(n, "dec")) for n in ("a", "b")}
    ref = {n: run(local, body(n, "local")) for n in ("a", "b")}
    for n in ("a", "b"):
        sent_embeds = sent[n]["inputs"]["text_encoder_output"]["prompt_embeds"]
        assert denoised[n]["seen"]["dit_inputs"]["prompt_embeds"] == sent_embeds
        assert denoised[n]["seen"]["dit_inputs"] == ref[n]["seen"]["dit_inputs"]
        assert decoded[n]["seen"]["vae_decode_input"] == ref[n]["seen"]["vae_decode_input"]
        assert decoded[n]["p2_meta"]["auto_height"] == 64  # from the Transformer's input info
        assert decoded[n]["p2_meta"]["auto_width"] == 96
        png = (tmp_path / f"dec-{n}.png").read_bytes()
        assert png == (tmp_path / f"local-{n}.png").read_bytes()  # the image, byte for byte
    # the two requests differ, so a mix-up of rooms could not have passed unseen
    assert sent["a"]["inputs"] != sent["b"]["inputs"]
    assert decoded["a"]["seen"] != decoded["b"]["seen"]
    assert (tmp_path / "dec-a.png").read_bytes() != (tmp_path / "dec-b.png").read_bytes()

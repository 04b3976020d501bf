"""Tiny stand-ins for LightX2V's models, installed over the runners' model
*loaders* only (``WanRunner.load_transformer`` etc.); every other line that runs
is LightX2V's own: config, ``init_modules``, the input encoders' glue
(``read_image_input``, ``run_vae_encoder``'s latent geometry and mask, text
padding), the real ``WanScheduler`` and denoising loop (``run_segment``), the
DisaggMixin role flows and the result handling.

Each fake is deterministic in its input, so two processes that get the same
bytes compute the same bytes, and each records a SHA-256 of what it was given
(``SEEN``), which the role worker reports.

For ``QwenImageRunner`` (``install("qwen_image")``) the same holds: replaced are
the Qwen2.5-VL text encoder (``load_text_encoder``: 7B parameters of weights),
the ``QwenImageTransformerModel`` (``load_transformer``: 20B parameters, and its
attention kernels need CUDA) and the VAE's network (``AutoencoderKLQwenImageVAE.
load``: weights). LightX2V's own VAE wrapper still runs around the tiny network
(latent unpacking, de-normalisation, ``VaeImageProcessor`` to PIL), as do the
real ``QwenImageScheduler`` (diffusers' ``FlowMatchEulerDiscreteScheduler``,
configured from the model folder's ``scheduler/scheduler_config.json``), the
latent packing, rotary embeddings, ``set_target_shape``/``set_img_shapes``, the
DisaggMixin role flows, ``apply_disagg_request_overrides`` and image saving.

A fault test holds a denoising step at a known point with ``test_gate`` in the
request (see ``hold``), in the file protocol of ``tests/gated.py``'s ``Gate``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

#: what each fake was last given: name -> {"dtype", "shape", "sha256"} or a dict of them
SEEN: dict[str, Any] = {}


def digest(t: torch.Tensor) -> dict:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return {
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
    }


def _seeded(text: str) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(text.encode()).hexdigest()[:12], 16))


class FakeT5:
    """``T5EncoderModel.infer(texts)``: one ``[tokens, dim]`` tensor per text."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def infer(self, texts: list[str]) -> list[torch.Tensor]:
        out = []
        for text in texts:
            tokens = max(1, min(len(text.split()), 8))
            out.append(torch.randn(tokens, self.dim, generator=_seeded(text)).to(torch.bfloat16))
        return out


class FakeCLIP:
    """``CLIPModel.visual(frames)``: ``[1, 257, 1280]`` from the frame's pixels."""

    def visual(self, frames: list[torch.Tensor]) -> torch.Tensor:
        frame = frames[0].float()
        SEEN["clip_input"] = digest(frames[0])
        base = torch.linspace(-1, 1, 257 * 1280).reshape(1, 257, 1280)
        return (base * frame.mean() + frame.std()).to(torch.float16)


class FakeVAE:
    """``WanVAE``: ``encode`` to ``[16, T', H/8, W/8]``; ``decode`` to ``[1, 3, T, H, W]``."""

    dtype = torch.bfloat16

    def __init__(self, stride: tuple[int, int, int], config: Any = None) -> None:
        self.stride = stride
        self.config = config  # the runner's: it holds the request's ``seed``

    def encode(self, video: torch.Tensor, **_: Any) -> torch.Tensor:
        SEEN["vae_encode_input"] = digest(video)
        st, sh, sw = self.stride
        t = video.shape[2]
        pooled = torch.nn.functional.avg_pool3d(
            video.float()[0], kernel_size=(1, sh, sw)
        )  # [3, T, H', W']
        frames = (t - 1) // st + 1
        pooled = pooled[:, ::st][:, :frames]
        return torch.cat([pooled] * 6)[:16].to(self.dtype)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        SEEN["vae_decode_input"] = digest(latents)
        seed = self.config.get("seed") if self.config is not None else None
        if seed is not None:  # a queue-mode decoder serves requests in any order
            SEEN[f"vae_decode_input@{seed}"] = SEEN["vae_decode_input"]
        st, sh, sw = self.stride
        x = latents.float()[:3].unsqueeze(0).tanh()  # [1, 3, T', h, w]
        x = x.repeat_interleave(sh, dim=3).repeat_interleave(sw, dim=4)
        return x.repeat_interleave(st, dim=2)[:, :, : (latents.shape[1] - 1) * st + 1]


class _SchedulerBound:
    """A DiT's ``set_scheduler``; ``_step()`` holds the step if the request asked."""

    def __init__(self) -> None:
        self.scheduler: Any = None

    def set_scheduler(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def _step(self) -> int:
        hold(self.scheduler.config, self.scheduler.step_index)
        return self.scheduler.step_index


class FakeDiT(_SchedulerBound):
    """``WanModel``: ``infer(inputs)`` leaves ``scheduler.noise_pred`` for the real
    scheduler's ``step_post``; records the inputs of a request's first step."""

    def infer(self, inputs: dict) -> None:
        self._step()
        text = inputs["text_encoder_output"]
        image = inputs.get("image_encoder_output") or {}
        if self.scheduler.step_index == 0:
            SEEN["dit_inputs"] = {
                k: digest(v) for k, v in {**text, **image}.items() if isinstance(v, torch.Tensor)
            }
        latents = self.scheduler.latents
        shift = text["context"].float().mean()
        if image.get("clip_encoder_out") is not None:
            shift = shift + image["clip_encoder_out"].float().mean()
        self.scheduler.noise_pred = 0.5 * latents + shift


#: a held step gives up after this long, so a broken test cannot hang a role
HOLD_MAX_S = 300.0


def hold(config: Any, step: int) -> None:
    """Hold this denoising step if the request asked for it: ``test_gate`` =
    ``{"dir", "rid", "step"}`` in the request (LightX2V's ``set_config`` puts it
    in the runner's config, which the scheduler shares). The first arrival of
    ``rid`` at ``step`` in any role writes ``<dir>/<rid>.reached`` (the role's
    queue ``worker_id``) and waits for ``<dir>/<rid>.released``; later arrivals
    (the item re-run elsewhere after a fault, or resumed after a yield) pass
    straight through. ``RoleGate`` in
    ``conftest.py`` is the test's side."""
    gate = config.get("test_gate") if config is not None else None
    if not gate or int(gate["step"]) != step:
        return
    root = Path(gate["dir"])
    try:
        fd = os.open(root / f"{gate['rid']}.reached", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    queue = (config.get("disagg_config") or {}).get("queue") or {}
    with os.fdopen(fd, "w") as f:
        json.dump({"worker_id": queue.get("worker_id"), "step": step, "pid": os.getpid()}, f)
    deadline = time.monotonic() + HOLD_MAX_S
    while not (root / f"{gate['rid']}.released").exists() and time.monotonic() < deadline:
        time.sleep(0.005)


class FakeQwenTextEncoder:
    """``Qwen25_VLForConditionalGeneration_TextEncoder.infer(texts)``:
    ``(prompt_embeds [1, tokens, dim], mask, image_info)``."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def infer(self, texts: list[str], image_list: Any = None) -> tuple:
        text = texts[0]
        tokens = max(1, min(len(text.split()), 8))
        emb = torch.randn(1, tokens, self.dim, generator=_seeded(text)).to(torch.bfloat16)
        return emb, torch.ones(1, tokens, dtype=torch.long), None


class FakeQwenDiT(_SchedulerBound):
    """``QwenImageTransformerModel``: ``infer(inputs)`` leaves ``scheduler.noise_pred``
    (packed ``[1, seq, C*4]``, like the latents) for the real scheduler's step."""

    def infer(self, inputs: dict) -> None:
        emb = inputs["text_encoder_output"]["prompt_embeds"]
        if self._step() == 0:
            SEEN["dit_inputs"] = {"prompt_embeds": digest(emb)}
        latents = self.scheduler.latents
        self.scheduler.noise_pred = (0.5 * latents.float() + emb.float().mean()).to(latents.dtype)


class TinyQwenVAENet:
    """What ``AutoencoderKLQwenImage.decode(z, return_dict=False)`` returns for
    ``z`` ``[B, 16, 1, h, w]``: ``([B, 3, 1, 8h, 8w],)`` in ``[-1, 1]``."""

    dtype = torch.bfloat16

    def decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple:
        SEEN["vae_decode_input"] = digest(z)
        x = z.float()[:, :3].tanh().repeat_interleave(8, dim=3).repeat_interleave(8, dim=4)
        return (x.to(z.dtype),)


def install(model_cls: str = "wan2.1") -> None:
    """Replace the model loaders of ``model_cls``'s runner by the fakes (on the class)."""
    if model_cls == "qwen_image":
        _install_qwen()
        return
    from lightx2v.models.runners.wan.wan_runner import WanRunner

    def vae(self: Any) -> FakeVAE:
        return FakeVAE(tuple(self.config["vae_stride"]), self.config)

    WanRunner.load_transformer = lambda self: FakeDiT()
    WanRunner.load_text_encoder = lambda self: [FakeT5(int(self.config["text_encoder_dim"]))]
    WanRunner.load_image_encoder = lambda self: FakeCLIP() if self.config["task"] == "i2v" else None
    WanRunner.load_vae_encoder = lambda self: vae(self) if self.config["task"] == "i2v" else None
    WanRunner.load_vae_decoder = vae


def _install_qwen() -> None:
    from diffusers.image_processor import VaeImageProcessor
    from lightx2v.models.runners.qwen_image.qwen_image_runner import QwenImageRunner
    from lightx2v.models.video_encoders.hf.qwen_image.vae import AutoencoderKLQwenImageVAE

    def vae_load(self: Any) -> None:  # the real wrapper, a tiny network inside
        self.model = TinyQwenVAENet()
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=self.config["vae_scale_factor"] * 2
        )

    AutoencoderKLQwenImageVAE.load = vae_load
    QwenImageRunner.load_transformer = lambda self: FakeQwenDiT()
    QwenImageRunner.load_text_encoder = lambda self: [
        FakeQwenTextEncoder(int(self.config.get("joint_attention_dim", 32)))
    ]

"""Tiny stand-ins for LightX2V's models, installed over the runners' model
*loaders* only (``WanRunner.load_transformer`` etc.); every other line that runs
is LightX2V's own: config, ``init_modules``, the input encoders' glue
(``read_image_input``, ``run_vae_encoder``'s latent geometry and mask, text
padding), the real ``WanScheduler`` and denoising loop (``run_segment``), the
DisaggMixin role flows and the result handling.

Each fake is deterministic in its input, so two processes that get the same
bytes compute the same bytes, and each records a SHA-256 of what it was given
(``SEEN``), which the role worker reports.
"""

from __future__ import annotations

import hashlib
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

    def __init__(self, stride: tuple[int, int, int]) -> None:
        self.stride = stride

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
        st, sh, sw = self.stride
        x = latents.float()[:3].unsqueeze(0).tanh()  # [1, 3, T', h, w]
        x = x.repeat_interleave(sh, dim=3).repeat_interleave(sw, dim=4)
        return x.repeat_interleave(st, dim=2)[:, :, : (latents.shape[1] - 1) * st + 1]


class FakeDiT:
    """``WanModel``: ``infer(inputs)`` leaves ``scheduler.noise_pred`` for the real
    scheduler's ``step_post``; records the inputs of a request's first step."""

    def __init__(self) -> None:
        self.scheduler: Any = None

    def set_scheduler(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def infer(self, inputs: dict) -> None:
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


def install() -> None:
    """Replace the Wan runner's model loaders by the fakes (on the class)."""
    from lightx2v.models.runners.wan.wan_runner import WanRunner

    def vae(self: Any) -> FakeVAE:
        return FakeVAE(tuple(self.config["vae_stride"]))

    WanRunner.load_transformer = lambda self: FakeDiT()
    WanRunner.load_text_encoder = lambda self: [FakeT5(int(self.config["text_encoder_dim"]))]
    WanRunner.load_image_encoder = lambda self: FakeCLIP() if self.config["task"] == "i2v" else None
    WanRunner.load_vae_encoder = lambda self: vae(self) if self.config["task"] == "i2v" else None
    WanRunner.load_vae_decoder = vae

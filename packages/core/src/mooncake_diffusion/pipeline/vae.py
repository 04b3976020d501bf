"""The Decode stage's model: a VAE-style decoder, causal in time, decoding chunk by chunk.

    dec = VaeDecoder(config)
    stream = dec.stream()                       # one per request: holds the causal cache
    for chunk in latent.tensor_split(n, dim=2): # latent [1, C, T, h, w], chunks along T
        frames = stream.feed(chunk)             # uint8 [F_chunk, 8h, 8w, 3]

Causal in time, as Wan's VAE: output frame group ``t`` depends on latent frames
``<= t`` only. Latent frame 0 decodes to 1 frame, every later one to 4 (so
``T`` latent frames give ``1 + 4(T - 1)`` frames). The stream carries a small
cache between chunks: the last two inputs of each temporal convolution. Every
latent frame is decoded by the same per-frame computation whatever the
chunking, so decoding in chunks as they arrive gives exactly the bytes of a
whole-latent decode.

Per latent frame: a causal temporal conv (3 taps) C -> ch, x2 upsample + conv,
a causal temporal conv (2 taps), two more x2 upsample + conv (stride 8 in all),
and a head producing 4 frames (1 for frame 0) of RGB, squashed to uint8.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mooncake_diffusion.pipeline.params import PipelineConfig
from mooncake_diffusion.pipeline.runtime import init_weights

__all__ = ["DecodeStream", "VaeDecoder", "frames_of"]


def frames_of(latent_frames: int, first: bool) -> int:
    """How many output frames ``latent_frames`` latent frames decode to; ``first`` when
    the chunk starts at latent frame 0."""
    if latent_frames == 0:
        return 0
    return 4 * latent_frames - 3 if first else 4 * latent_frames


class _CausalConv(nn.Module):
    """``out_t = sum_k conv2d_k(x_{t-k})`` over ``taps`` frames (zeros before frame 0)."""

    def __init__(self, cin: int, cout: int, taps: int) -> None:
        super().__init__()
        self.taps = nn.ModuleList(
            nn.Conv2d(cin, cout, 3, padding=1, bias=i == 0) for i in range(taps)
        )

    def forward(self, x: torch.Tensor, past: list[torch.Tensor]) -> torch.Tensor:
        """``x`` [B, C, h, w]; ``past`` the previous inputs, newest last (updated in place)."""
        out = self.taps[0](x)
        for k in range(1, len(self.taps)):
            if len(past) >= k:
                out = out + self.taps[k](past[-k])
        past.append(x)
        del past[: -(len(self.taps) - 1) or None]
        return out


class VaeDecoder(nn.Module):
    """Latent ``[1, C, T, h, w]`` -> frames; use ``stream()`` (or ``decode`` for all of it)."""

    def __init__(self, config: PipelineConfig) -> None:
        super().__init__()
        c, ch = config.latent_channels, config.vae_channels
        self.t1 = _CausalConv(c, ch, 3)
        self.up1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.t2 = _CausalConv(ch, ch, 2)
        self.up2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.up3 = nn.Conv2d(ch, ch, 3, padding=1)
        self.head = nn.Conv2d(ch, 4 * 3, 3, padding=1)
        init_weights(self, config.weights_seed * 3 + 3, gain=1.4)
        self.eval()

    def stream(self) -> DecodeStream:
        """A fresh decode of one request (empty causal cache)."""
        return DecodeStream(self)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """The whole latent at once: ``uint8 [1 + 4(T-1), 8h, 8w, 3]``."""
        return self.stream().feed(latent)

    def frame(
        self, z: torch.Tensor, cache: dict[str, list[torch.Tensor]], first: bool
    ) -> torch.Tensor:
        """One latent frame ``z`` [1, C, h, w] -> float frames [n, 3, 8h, 8w] in (-1, 1)."""
        x = F.silu(self.t1(z, cache["t1"]))
        x = F.silu(self.up1(F.interpolate(x, scale_factor=2.0, mode="nearest")))
        x = F.silu(self.t2(x, cache["t2"]))
        x = F.silu(self.up2(F.interpolate(x, scale_factor=2.0, mode="nearest")))
        x = F.silu(self.up3(F.interpolate(x, scale_factor=2.0, mode="nearest")))
        rgb = torch.tanh(self.head(x))  # [1, 12, H, W]
        groups = rgb.reshape(4, 3, *rgb.shape[-2:])
        return groups[:1] if first else groups


class DecodeStream:
    """One request's decode, fed latent chunks in temporal order (not thread-safe).

    ``feed`` takes ``[1, C, t, h, w]`` with any ``t >= 0`` and returns the frames of
    those latent frames, ``uint8 [F, 8h, 8w, 3]``, HWC, ready to write.
    ``latent_frames`` counts what has been fed so far.
    """

    def __init__(self, decoder: VaeDecoder) -> None:
        self._dec = decoder
        self._cache: dict[str, list[torch.Tensor]] = {"t1": [], "t2": []}
        self.latent_frames = 0

    def feed(self, chunk: torch.Tensor) -> torch.Tensor:
        if chunk.dim() != 5 or chunk.shape[0] != 1:
            raise ValueError(f"a latent chunk is [1, C, t, h, w], got {tuple(chunk.shape)}")
        out = []
        for i in range(chunk.shape[2]):
            first = self.latent_frames == 0
            out.append(self._dec.frame(chunk[:, :, i].contiguous(), self._cache, first))
            self.latent_frames += 1
        if not out:
            h, w = chunk.shape[-2] * 8, chunk.shape[-1] * 8
            return torch.empty((0, h, w, 3), dtype=torch.uint8)
        rgb = torch.cat(out, dim=0)  # [F, 3, H, W]
        pixels = ((rgb + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).contiguous()

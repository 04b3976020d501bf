"""The Denoise stage's model: a small DiT over patchified video latents.

    dit = DiT(config)
    v = dit(latent, sigma, text)     # latent [B, C, T, H, W], sigma [B], text [B, L, D]
                                     # -> predicted flow velocity, same shape as latent

Tokens are 1 x p x p patches of the latent (an image is T = 1), with fixed 3-D
sinusoidal positions. Each block: adaptive LayerNorm modulated by the noise
level (shift, scale, gate), self-attention over all video tokens, cross-attention
to the text embeddings, MLP. The cost per forward grows with T*H*W/p^2 tokens,
as a real video DiT's does.
"""

from __future__ import annotations

import torch
from torch import nn

from mooncake_diffusion.pipeline.layers import MLP, Attention, sinusoidal, sinusoidal_3d
from mooncake_diffusion.pipeline.params import PipelineConfig
from mooncake_diffusion.pipeline.runtime import init_weights

__all__ = ["DiT"]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, text_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.cross = Attention(dim, heads, ctx_dim=text_dim)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = MLP(dim)
        self.mod = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        s1, sc1, g1, s2, sc2, g2 = self.mod(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + torch.tanh(g1) * self.attn(self.norm1(x) * (1 + sc1) + s1)
        x = x + self.cross(self.norm2(x), text)
        return x + torch.tanh(g2) * self.mlp(self.norm3(x) * (1 + sc2) + s2)


class DiT(nn.Module):
    """Velocity predictor ``v(x, sigma, text)`` for flow matching (see module docstring)."""

    def __init__(self, config: PipelineConfig) -> None:
        super().__init__()
        d, p, c = config.dit_dim, config.patch, config.latent_channels
        self.p = p
        self.dim = d
        self.patch_in = nn.Linear(c * p * p, d)
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(
            _Block(d, config.dit_heads, config.text_dim) for _ in range(config.dit_depth)
        )
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.mod_out = nn.Linear(d, 2 * d)
        self.patch_out = nn.Linear(d, c * p * p)
        init_weights(self, config.weights_seed * 3 + 2)
        self.eval()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        p = self.p
        hp, wp = h // p, w // p
        tokens = (
            x.reshape(b, c, t, hp, p, wp, p)
            .permute(0, 2, 3, 5, 1, 4, 6)
            .reshape(b, t * hp * wp, c * p * p)
        )
        z = self.patch_in(tokens) + sinusoidal_3d(t, hp, wp, self.dim)
        cond = self.time_mlp(sinusoidal(sigma * 1000.0, self.dim))
        for blk in self.blocks:
            z = blk(z, cond, text)
        shift, scale = self.mod_out(cond).unsqueeze(1).chunk(2, dim=-1)
        out = self.patch_out(self.norm_out(z) * (1 + scale) + shift)
        return (
            out.reshape(b, t, hp, wp, c, p, p).permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, t, h, w)
        )

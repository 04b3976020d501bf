"""Building blocks shared by the text encoder and the DiT: attention, MLP, positions.

Attention is written out (matmul, softmax, matmul) rather than calling a fused
kernel, so the arithmetic is the same on every CPU build and its cost is plain.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["MLP", "Attention", "sinusoidal", "sinusoidal_3d"]


class Attention(nn.Module):
    """Multi-head attention of ``x`` [B, N, dim] over ``context`` [B, M, ctx_dim]
    (self-attention when ``context`` is None)."""

    def __init__(self, dim: int, heads: int, ctx_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(ctx_dim or dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        ctx = x if context is None else context
        h, hd = self.heads, d // self.heads
        q = self.q(x).view(b, n, h, hd).transpose(1, 2)
        k, v = self.kv(ctx).view(b, ctx.shape[1], 2, h, hd).permute(2, 0, 3, 1, 4)
        w = torch.softmax((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd)), dim=-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ratio * dim)
        self.fc2 = nn.Linear(ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def sinusoidal(pos: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[len(pos), dim]`` sin/cos features of the float positions ``pos`` (dim even)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    angles = pos.to(torch.float32)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def sinusoidal_3d(t: int, h: int, w: int, dim: int) -> torch.Tensor:
    """``[t*h*w, dim]`` positions of a (t, h, w) token grid, row-major; dim % 6 == 0."""
    part = dim // 3
    grid = torch.stack(
        torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), dim=-1
    ).reshape(-1, 3)
    return torch.cat([sinusoidal(grid[:, i], part) for i in range(3)], dim=-1)

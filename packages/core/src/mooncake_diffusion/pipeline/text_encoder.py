"""The Encode stage's model: a small pre-LN transformer over byte tokens -> [1, L, D].

    enc = TextEncoder(config)                # weights from config.weights_seed
    embeds = enc(tokenize(prompt, L))        # [1, L, text_dim] float32

One prompt per call (batch 1): a prompt's embedding is then the same bytes
whichever request or process encodes it, which is what makes an embedding cache
hit indistinguishable from a fresh encode.
"""

from __future__ import annotations

import torch
from torch import nn

from mooncake_diffusion.pipeline.layers import MLP, Attention, sinusoidal
from mooncake_diffusion.pipeline.params import PipelineConfig
from mooncake_diffusion.pipeline.runtime import init_weights
from mooncake_diffusion.pipeline.tokenizer import VOCAB

__all__ = ["TextEncoder"]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    """Token ids ``[1, L]`` -> embeddings ``[1, L, config.text_dim]``."""

    def __init__(self, config: PipelineConfig) -> None:
        super().__init__()
        d = config.text_dim
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(_Block(d, config.text_heads) for _ in range(config.text_layers))
        self.norm = nn.LayerNorm(d)
        self.register_buffer("pos", sinusoidal(torch.arange(config.text_len), d), persistent=False)
        init_weights(self, config.weights_seed * 3 + 1)
        self.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

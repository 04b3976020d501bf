"""Deterministic test tensors: the same (dtype, shape, seed) gives the same bytes
in every process, so a consumer can check a producer's bytes without a copy
travelling beside them."""

from __future__ import annotations

import torch

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=DTYPES[dtype])
    raw = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )

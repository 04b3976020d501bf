"""Deterministic tokenisation: UTF-8 bytes, no vocabulary file, the same ids everywhere.

    ids = tokenize("a red fox", length=32)   # [1, 32] int64: BOS, bytes + 3, EOS, PAD...

Ids: 0 PAD, 1 BOS, 2 EOS, ``3 + b`` for byte ``b``; a prompt longer than
``length - 2`` bytes is cut (at a byte, so a multi-byte character may be split,
deterministically). ``VOCAB`` is 259.
"""

from __future__ import annotations

import torch

__all__ = ["BOS", "EOS", "PAD", "VOCAB", "tokenize"]

PAD, BOS, EOS = 0, 1, 2
VOCAB = 3 + 256


def tokenize(text: str, length: int) -> torch.Tensor:
    """``[1, length]`` int64 token ids of ``text`` (see the module docstring)."""
    if length < 3:
        raise ValueError(f"length must be >= 3, got {length}")
    body = [3 + b for b in text.encode("utf-8")[: length - 2]]
    ids = [BOS, *body, EOS]
    ids += [PAD] * (length - len(ids))
    return torch.tensor([ids], dtype=torch.int64)

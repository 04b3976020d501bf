"""Small test helpers; the deterministic tensors come from the package's demo so
producer processes and tests agree on every byte."""

from __future__ import annotations

import torch

from mooncake_diffusion.handoff import make_tensor

__all__ = ["make_tensor", "same_bytes"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every byte (NaN payloads included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )

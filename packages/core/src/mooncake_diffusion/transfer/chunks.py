"""Chunk plans: which byte ranges of which tensor make up chunk ``i`` of a payload.

A payload chunked ``num_chunks`` ways along ``chunk_dim`` is cut the way
``torch.tensor_split`` cuts: the first ``size % n`` chunks get one more slice.
Chunk ``i`` of the payload is chunk ``i`` of every tensor. For a contiguous
tensor, a chunk along the outermost dim is one byte range; along an inner dim
(``[B, C, T, H, W]`` along T) it is one range per index of the outer dims.
Nothing is copied: ranges address the tensor's own registered memory.

Pure logic, shared by producers and consumers, who compute the same plan from
the handle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mooncake_diffusion.wire.schema import DTYPE_SIZES, PayloadHandle, TensorSpec

__all__ = ["Segment", "chunk_bounds", "plan", "plan_for"]


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``offset`` from the start of tensor number ``tensor``."""

    tensor: int
    offset: int
    length: int


def chunk_bounds(size: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``n`` near-equal chunks of ``size``."""
    q, r = divmod(size, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _tensor_segments(index: int, spec: TensorSpec, dim: int, n: int) -> list[list[Segment]]:
    itemsize = DTYPE_SIZES[spec.dtype]
    outer = math.prod(spec.shape[:dim])
    inner = math.prod(spec.shape[dim + 1 :]) * itemsize
    row = spec.shape[dim] * inner
    chunks = []
    for start, stop in chunk_bounds(spec.shape[dim], n):
        length = (stop - start) * inner
        if length == 0 or outer == 0:
            chunks.append([])
        elif start == 0 and stop == spec.shape[dim]:
            chunks.append([Segment(index, 0, outer * row)])
        else:
            chunks.append([Segment(index, o * row + start * inner, length) for o in range(outer)])
    return chunks


def plan(
    specs: tuple[TensorSpec, ...] | list[TensorSpec], chunk_dim: int | None, num_chunks: int
) -> list[list[Segment]]:
    """Per chunk, the segments to move, tensors in order. Unchunked (``chunk_dim``
    ``None``) is one chunk holding every non-empty tensor whole. The arguments are
    assumed valid (``schema.check_chunking`` checks them)."""
    if chunk_dim is None:
        return [[Segment(i, 0, s.nbytes) for i, s in enumerate(specs) if s.nbytes]]
    chunks: list[list[Segment]] = [[] for _ in range(num_chunks)]
    for i, spec in enumerate(specs):
        for c, segs in enumerate(_tensor_segments(i, spec, chunk_dim, num_chunks)):
            chunks[c].extend(segs)
    return chunks


def plan_for(handle: PayloadHandle) -> list[list[Segment]]:
    """The chunk plan a handle describes."""
    return plan(handle.tensors, handle.chunk_dim, handle.num_chunks)

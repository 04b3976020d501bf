import ctypes

import pytest
import torch

from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.transfer.chunks import chunk_bounds, plan
from mooncake_diffusion.wire.schema import check_chunking

pytestmark = pytest.mark.unit


def gather(t: torch.Tensor, segments) -> bytes:
    return b"".join(ctypes.string_at(t.data_ptr() + s.offset, s.length) for s in segments)


@pytest.mark.parametrize(
    ("shape", "dim", "n"),
    [
        ((1, 16, 21, 9, 16), 2, 8),
        ((1, 16, 21, 9, 16), 2, 21),
        ((4, 3), 0, 3),
        ((2, 3, 5), 2, 2),
        ((7,), 0, 7),
        ((2, 5, 3), 1, 4),
        ((3, 0, 4), 2, 2),
    ],
)
def test_chunk_bytes_equal_tensor_split_pieces(shape, dim, n):
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).reshape(shape)
    spec, _ = describe("x", t)
    chunks = plan([spec], dim, n)
    pieces = torch.tensor_split(t, n, dim)
    assert len(chunks) == n
    for segs, piece in zip(chunks, pieces, strict=True):
        assert gather(t, segs) == piece.contiguous().numpy().tobytes()
    assert sum(s.length for c in chunks for s in c) == t.nbytes


def test_outermost_dim_is_one_range_per_chunk_inner_dim_one_per_outer_index():
    spec, _ = describe("x", torch.zeros(2, 4, 6, 8, dtype=torch.bfloat16))
    assert all(len(c) == 1 for c in plan([spec], 0, 2))
    assert all(len(c) == 2 * 4 for c in plan([spec], 2, 3))  # B*C ranges along T


def test_unchunked_plan_is_one_chunk_of_whole_non_empty_tensors():
    a, _ = describe("a", torch.zeros(3))
    b, _ = describe("b", torch.zeros(0))
    (only,) = plan([a, b], None, 1)
    assert [(s.tensor, s.offset, s.length) for s in only] == [(0, 0, 12)]


def test_bounds_are_near_equal_and_cover():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize(
    ("dim", "n", "match"),
    [
        (5, 2, "out of range"),
        (-1, 2, "out of range"),
        (2, 22, "more than dim"),
        (2, 0, "num_chunks"),
        (None, 3, "needs a chunk_dim"),
    ],
)
def test_bad_chunking_is_rejected(dim, n, match):
    spec, _ = describe("x", torch.zeros(1, 16, 21, 9, 16))
    with pytest.raises(ValueError, match=match):
        check_chunking([spec], dim, n)

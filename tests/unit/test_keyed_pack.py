"""Object trees <-> (skeleton, tensors) for the keyed handoff: pure logic, no store."""

import msgspec
import numpy as np
import pytest
import torch

from mooncake_diffusion.errors import HandleError, PayloadError
from mooncake_diffusion.handoff.keyed import pack, unpack

pytestmark = pytest.mark.unit


class Meta(msgspec.Struct, omit_defaults=True, kw_only=True):
    finished: torch.Tensor | None = None
    chunk_seq: int | None = None


def roundtrip(obj, inline_bytes=1024):
    skeleton, moved = pack(obj, inline_bytes)
    # what a consumer receives: fresh copies of the moved tensors
    received = {
        i: t.clone() if isinstance(t, torch.Tensor) else t.copy() for i, (_, t) in enumerate(moved)
    }
    return unpack(skeleton, received), moved


def test_large_tensors_move_small_ones_ride_inline():
    big, small = torch.randn(64, 64), torch.arange(5)
    out, moved = roundtrip({"big": big, "small": small, "ids": [1, 2, 3]})
    assert [k for k, _ in moved] == ["torch"]
    assert moved[0][1].data_ptr() == big.data_ptr()  # no copy before sending
    assert torch.equal(out["big"], big) and torch.equal(out["small"], small)
    assert out["ids"] == [1, 2, 3]


def test_bf16_bool_empty_and_zero_dim_tensors_inline():
    obj = {
        "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(2.5),
    }
    out, moved = roundtrip(obj)
    assert moved == []
    for k, v in obj.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v)


def test_structs_come_back_as_dicts_of_their_set_fields():
    out, _ = roundtrip(Meta(finished=torch.tensor(False), chunk_seq=3))
    assert isinstance(out, dict) and set(out) == {"finished", "chunk_seq"}
    assert out["chunk_seq"] == 3 and out["finished"].item() is False


def test_numpy_arrays_scalars_and_tuples():
    arr = np.arange(1000, dtype=np.float32)
    out, moved = roundtrip({"a": arr, "n": np.int64(4), "t": (1, 2)})
    assert [k for k, _ in moved] == ["numpy"]
    assert isinstance(out["a"], np.ndarray) and np.array_equal(out["a"], arr)
    assert out["n"] == 4 and out["t"] == [1, 2]


@pytest.mark.parametrize("size", [100, 2048])  # inline, and moved as a tensor
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_raw_bytes_of_any_size_and_kind_come_back_as_bytes(size, kind):
    raw = (bytes(range(256)) * 8)[:size]
    skeleton, moved = pack(kind(raw), 1024)
    assert [k for k, _ in moved] == (["bytes"] if size >= 1024 else [])
    out = unpack(skeleton, {0: bytearray(raw)} if moved else {})
    assert type(out) is bytes and out == raw


def test_non_contiguous_tensor_is_made_contiguous():
    t = torch.randn(128, 64).t()
    out, moved = roundtrip(t)
    assert moved[0][1].is_contiguous() and torch.equal(out, t)


def test_unsupported_objects_are_rejected_before_sending():
    with pytest.raises(PayloadError, match="without pickle"):
        pack({"x": object()}, 1024)


def test_a_skeleton_naming_a_tensor_that_did_not_arrive_is_rejected():
    skeleton, _ = pack({"big": torch.randn(64, 64)}, 1024)
    with pytest.raises(HandleError, match="did not arrive"):
        unpack(skeleton, {})


@pytest.mark.parametrize(
    "ext",
    [
        ("torch", "gloat32", (2, 2), b"\0" * 16),  # no such dtype
        ("torch", "float32", (2, 2), b"\0" * 15),  # bytes do not fill the shape
        ("torch", "float32", (-1, 2), b""),  # negative dim
        ("numpy", "O", (1,), b"\0" * 8),  # objects cannot travel
        ("numpy", "not-a-dtype", (1,), b"\0"),
        ("pickle", "float32", (1,), b"\0" * 4),  # unknown kind
    ],
)
def test_a_corrupt_inline_tensor_is_a_handle_error(ext):
    """Found by fuzzing (tests/chaos/fuzz.py): these raised AttributeError, TypeError,
    ValueError or RuntimeError out of ``unpack`` instead of its typed error."""
    from mooncake_diffusion.handoff.keyed import EXT_TENSOR

    skeleton = msgspec.msgpack.encode(
        {"x": msgspec.msgpack.Ext(EXT_TENSOR, msgspec.msgpack.encode(ext))}
    )
    with pytest.raises(HandleError, match="keyed record"):
        unpack(skeleton, {})


@pytest.fixture
def no_gc():
    """The cyclic garbage collector off: what is freed is freed by reference counting."""
    import gc

    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_unpacked_tensors_die_with_the_callers_last_reference(no_gc):
    """A receive's tensors live in recycled buffers that come back only when the caller
    drops them; ``unpack`` must not keep them in a reference cycle until a gc pass
    (it did: every receive then allocated fresh memory)."""
    import weakref

    skeleton, _ = pack({"big": torch.randn(64, 64), "nested": [{"b": torch.randn(64, 64)}]}, 1024)
    received = {0: torch.randn(64, 64), 1: torch.randn(64, 64)}
    gone = [weakref.ref(t) for t in received.values()]
    out = unpack(skeleton, received)
    assert out["big"] is received[0] and out["nested"][0]["b"] is received[1]
    del out, received
    assert [r() for r in gone] == [None, None]


def test_pack_keeps_no_reference_to_the_callers_tensors(no_gc):
    import weakref

    big = {"a": torch.randn(64, 64), "n": [np.zeros(4096)], "s": Meta(finished=torch.ones(1))}
    gone = [weakref.ref(big["a"]), weakref.ref(big["n"][0])]
    skeleton, moved = pack(big, 1024)
    assert len(moved) == 2 and skeleton
    del big, moved
    assert [r() for r in gone] == [None, None]

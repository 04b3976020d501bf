"""The connector contract, run against the in-package fake (unit) and against
real Mooncake p2p and store transports (integration), in one process here;
tests/integration/test_cross_process.py runs producer and consumer apart."""

import asyncio

import numpy as np
import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import StagePayload, decode_handle
from mooncake_diffusion.errors import (
    AlreadyConsumedError,
    DestinationMismatchError,
    DuplicatePublishError,
    HandleError,
    PayloadError,
    PayloadGoneError,
)


def publish(prod, request_id="r1", **kw):
    kw.setdefault("tensors", {"latent": make_tensor("bfloat16", (1, 4, 3, 8, 8), 1)})
    return prod.publish(StagePayload(request_id=request_id, kind=kw.pop("kind", "latent"), **kw))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int64"])
def test_bytes_arrive_unchanged_in_a_fresh_pool_view(pair, dtype):
    prod, cons = pair
    x = make_tensor(dtype, (2, 3, 5, 7), 7)
    pub = prod.publish(StagePayload("r1", "latent", tensor=x, meta={"steps": 4}))
    with cons.consume(pub.wait(10).encode()) as got:
        assert same_bytes(got.tensor, x)
        assert got.meta == {"steps": 4}
        assert got.tensor.data_ptr() != x.data_ptr()


def test_multi_tensor_payload_into_caller_destinations_returns_those_tensors(pair):
    prod, cons = pair
    src = {
        "context": make_tensor("bfloat16", (1, 512, 64), 2),
        "mask": make_tensor("int64", (1, 512), 3),
    }
    pub = prod.publish(StagePayload("r1", "embedding", tensors=src))
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    cons.register(dst["context"])
    got = cons.consume(pub.wait(10), dst=dst)
    assert got["context"] is dst["context"] and got["mask"] is dst["mask"]
    assert all(same_bytes(dst[k], src[k]) for k in src)
    got.release()


def test_numpy_arrays_travel_too(pair):
    prod, cons = pair
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    pub = prod.publish(StagePayload("r1", "feature", tensor=x))
    dst = np.zeros_like(x)
    cons.consume(pub.wait(10), dst=dst).release()
    assert np.array_equal(dst, x)


def test_zero_size_tensor_beside_a_real_one(pair):
    prod, cons = pair
    src = {"empty": torch.empty(0, 16), "x": make_tensor("float32", (16,), 4)}
    pub = prod.publish(StagePayload("r1", "latent", tensors=src))
    with cons.consume(pub.wait(10)) as got:
        assert got["empty"].shape == (0, 16)
        assert same_bytes(got["x"], src["x"])


def test_consuming_delete_on_consume_twice_fails_and_connector_goes_on(pair):
    prod, cons = pair
    pub = publish(prod)
    handle = pub.wait(10).encode()
    cons.consume(handle).release()
    with pytest.raises(AlreadyConsumedError):
        cons.consume(handle)
    pub2 = publish(prod, "r2")
    cons.consume(pub2.wait(10)).release()


def test_shared_payload_serves_many_reads_until_released(pair):
    prod, cons = pair
    x = make_tensor("float32", (64,), 5)
    pub = prod.publish(StagePayload("r1", "embedding", tensor=x, lease="shared"))
    for _ in range(3):
        with cons.consume(pub.wait(10)) as got:
            assert same_bytes(got.tensor, x)
    pub.release()
    with pytest.raises(PayloadGoneError):
        cons.consume(pub.handle, timeout=0.3)


def test_duplicate_publish_is_rejected_until_cleanup(pair):
    prod, cons = pair
    pub = publish(prod, lease="shared")
    with pytest.raises(DuplicatePublishError):
        publish(prod, lease="shared")
    assert prod.cleanup("r1") == 1
    pub2 = publish(prod)
    cons.consume(pub2.wait(10)).release()
    with pytest.raises(PayloadGoneError):
        cons.consume(pub.handle, timeout=0.3)


def test_non_contiguous_and_unsupported_tensors_are_rejected_before_anything_moves(pair):
    prod, _ = pair
    x = torch.zeros(8, 8).t()
    with pytest.raises(PayloadError, match="not contiguous"):
        prod.publish(StagePayload("r1", "latent", tensor=x))
    with pytest.raises(PayloadError, match="unsupported dtype"):
        prod.publish(StagePayload("r1", "latent", tensor=torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(PayloadError, match=r"torch\.Tensor or numpy"):
        prod.publish(StagePayload("r1", "latent", tensor=[1, 2, 3]))
    assert prod.stats().live_publications == 0


@pytest.mark.parametrize(
    ("dst", "match"),
    [
        (torch.empty(1, 4, 3, 8, 8, dtype=torch.float16), "dtype"),
        (torch.empty(1, 4, 3, 8, 4, dtype=torch.bfloat16), "holds"),
        (torch.empty(1, 4, 3, 4, 16, dtype=torch.bfloat16), "shape"),
        ({"wrong": torch.empty(1)}, "names"),
    ],
)
def test_destination_mismatch_leaves_the_payload_consumable(pair, dst, match):
    prod, cons = pair
    pub = publish(prod)
    with pytest.raises(DestinationMismatchError, match=match):
        cons.consume(pub.wait(10), dst=dst)
    cons.consume(pub).release()


def test_corrupt_handle_bytes_raise_handle_error(pair):
    _, cons = pair
    with pytest.raises(HandleError):
        cons.consume(b"\x93\xa3mcd\x01\xc0")


def test_one_slow_publish_does_not_gate_another(pair):
    prod, cons = pair
    big = make_tensor("uint8", (32 << 20,), 6)
    slow = prod.publish(StagePayload("big", "latent", tensor=big))
    small = publish(prod, "small")
    with cons.consume(small.wait(30)) as got:
        assert got.tensor.shape == (1, 4, 3, 8, 8)
    with cons.consume(slow.wait(30)) as got:
        assert same_bytes(got.tensor, big)


def test_publication_can_be_awaited(pair):
    prod, cons = pair

    async def run():
        return await publish(prod)

    handle = asyncio.run(run())
    assert decode_handle(handle.encode()) == handle
    cons.consume(handle).release()


def test_consumed_publications_hold_nothing_in_the_producer(pair):
    prod, cons = pair
    x = make_tensor("float32", (256,), 9)
    for i in range(20):
        pub = prod.publish(StagePayload(f"r{i}", "latent", tensor=x))
        cons.consume(pub.wait(10)).release()
    assert prod.stats().live_publications == 0
    assert prod.stats().temporary_registrations == 0
    # still a duplicate on this connector until the request is cleaned up
    with pytest.raises(DuplicatePublishError):
        prod.publish(StagePayload("r0", "latent", tensor=x))
    prod.cleanup("r0")
    cons.consume(prod.publish(StagePayload("r0", "latent", tensor=x)).wait(10)).release()

"""The connector contract, run against the in-package fake (unit) and against
real Mooncake p2p and store transports (integration), in one process here;
tests/integration/test_cross_process.py runs producer and consumer apart."""

import asyncio
import time

import numpy as np
import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import StagePayload, decode_handle
from mooncake_diffusion.errors import (
    AlreadyConsumedError,
    DeadlineExceededError,
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


def test_chunked_payload_yields_views_of_dst_in_order(pair):
    prod, cons = pair
    x = make_tensor("bfloat16", (1, 4, 12, 6, 8), 11)  # [B, C, T, H, W]
    pub = prod.publish(StagePayload("r1", "latent", tensor=x, chunk_dim=2, num_chunks=5))
    dst = torch.empty_like(x)
    got = cons.consume(pub, dst=dst)
    pieces = torch.tensor_split(x, 5, 2)
    seen = []
    for chunk in got:
        seen.append(chunk.index)
        assert chunk.tensor.data_ptr() >= dst.data_ptr()  # a view into dst, not a copy
        assert same_bytes(chunk.tensor.contiguous(), pieces[chunk.index].contiguous())
    assert seen == [0, 1, 2, 3, 4]
    assert got.tensor is dst and same_bytes(dst, x)
    got.release()
    pub.wait(10)


def test_streaming_producer_consumer_sees_chunk_0_before_chunk_1_exists(pair):
    prod, cons = pair
    buf = torch.zeros(1, 2, 4, 8, 8)
    final = make_tensor("float32", (1, 2, 4, 8, 8), 12)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=-3, num_chunks=4), stream=True
    )
    got = cons.consume(pub.handle)
    for i in range(4):
        buf[:, :, i] = final[:, :, i]  # the producer "computes" chunk i ...
        pub.chunk_ready(i)  # ... and hands it over
        chunk = got.chunk(i, timeout=10)  # the consumer has it before chunk i+1 exists
        assert same_bytes(chunk.tensor.contiguous(), final[:, :, i : i + 1].contiguous())
        if i < 3:
            assert not buf[:, :, i + 1].any()
    assert same_bytes(got.tensor, final)
    got.release()
    pub.wait(10)


def test_a_specific_chunk_can_be_awaited_out_of_order(pair):
    prod, cons = pair
    x = make_tensor("float32", (6, 32), 13)
    pub = prod.publish(StagePayload("r1", "latent", tensor=x, chunk_dim=0, num_chunks=3))
    with cons.consume(pub) as got:
        assert same_bytes(got.chunk(2).tensor, x[4:6])
        assert same_bytes(got.chunk(0).tensor, x[0:2])
        with pytest.raises(PayloadError, match="out of range"):
            got.chunk(3)


@pytest.mark.parametrize(
    ("dim", "n", "match"),
    [(7, 2, "out of range"), (0, 2, "more than dim"), (2, 13, "more than dim")],
)
def test_bad_chunk_plans_are_rejected_and_leave_nothing(pair, dim, n, match):
    prod, _ = pair
    x = torch.zeros(1, 4, 12)
    with pytest.raises(PayloadError, match=match):
        prod.publish(StagePayload("r1", "latent", tensor=x, chunk_dim=dim, num_chunks=n))
    assert prod.stats().live_publications == 0


def test_destination_with_the_wrong_shape_for_the_plan_is_rejected(pair):
    prod, cons = pair
    x = make_tensor("float32", (1, 4, 12), 14)
    pub = prod.publish(StagePayload("r1", "latent", tensor=x, chunk_dim=2, num_chunks=4))
    with pytest.raises(DestinationMismatchError, match="shape"):
        cons.consume(pub, dst=torch.empty(1, 12, 4))
    cons.consume(pub).release()


def test_chunk_ready_is_checked_and_a_stream_released_early_leaves_nothing(pair):
    prod, cons = pair
    buf = make_tensor("float32", (4, 16), 15)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=0, num_chunks=4), stream=True
    )
    pub.chunk_ready(0)
    with pytest.raises(PayloadError, match="already marked"):
        pub.chunk_ready(0)
    with pytest.raises(PayloadError, match="out of range"):
        pub.chunk_ready(4)
    got = cons.consume(pub.handle, timeout=2)
    assert same_bytes(got.chunk(0).tensor, buf[0:1])
    pub.release()  # the producer gives up after one chunk
    with pytest.raises((PayloadGoneError, DeadlineExceededError)):
        got.wait()
    got.release()
    assert prod.stats().live_publications == 0


def test_a_payload_past_its_ttl_is_gone_consumed_or_not(pair):
    prod, cons = pair
    x = make_tensor("float32", (64,), 16)
    pub = prod.publish(StagePayload("r1", "latent", tensor=x, ttl_s=0.3))
    assert pub.wait(10).expires_at is not None
    time.sleep(0.4)
    with pytest.raises(PayloadGoneError, match="expired"):
        cons.consume(pub.handle)
    prod.cleanup("r1")  # what the reaper does for store payloads (tests/faults)
    assert prod.stats().live_publications == 0
    with pytest.raises(PayloadError, match="ttl_s"):
        StagePayload("r2", "latent", tensor=x, ttl_s=0)


def test_wait_delivered_returns_once_the_payload_no_longer_needs_its_producer(pair):
    """p2p: only after the consumer has taken the bytes (until then it times out);
    store and the fake: as soon as the payload is committed."""
    prod, cons = pair
    pub = publish(prod)
    handle = pub.wait(10)
    if handle.transport == "p2p":
        with pytest.raises(DeadlineExceededError, match="not taken"):
            pub.wait_delivered(0.2)  # nobody consumes: the producer still holds the bytes
    with cons.consume(handle.encode()) as got:
        got.wait()
    assert pub.wait_delivered(10) is handle

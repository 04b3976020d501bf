"""Producer and consumer in separate processes, real master and store host."""

import dataclasses

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import DiffusionConnector, StagePayload
from mooncake_diffusion.errors import AlreadyConsumedError, PayloadGoneError
from mooncake_diffusion.handoff.demo import ProducerProcess

pytestmark = pytest.mark.integration

KB, MB = 1 << 10, 1 << 20
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}


@pytest.fixture
def producer(mooncake_cluster, connector_factory):
    # connector_factory first, so its leak check runs after the producer exits
    with ProducerProcess(mooncake_cluster.settings) as p:
        yield p


def publish(producer, mode, request_id, dtype, shape, seed, **kw):
    r = producer.request(
        op="publish",
        mode=mode,
        request_id=request_id,
        dtype=dtype,
        shape=list(shape),
        seed=seed,
        **kw,
    )
    assert r["ok"], r
    return bytes.fromhex(r["handle"])


@pytest.mark.parametrize("mode", ["p2p", "store"])
@pytest.mark.parametrize(
    ("nbytes", "dtype"),
    [
        (KB, "bfloat16"),
        (MB, "float16"),
        (16 * MB, "float32"),
        (64 * MB, "int64"),
        (256 * MB, "bfloat16"),
    ],
    ids=["1KB-bf16", "1MB-fp16", "16MB-fp32", "64MB-int64", "256MB-bf16"],
)
def test_bytes_cross_processes_unchanged(producer, connector_factory, mode, nbytes, dtype):
    shape = (nbytes // ITEMSIZE[dtype] // 64, 64)
    handle = publish(producer, mode, f"r-{nbytes}", dtype, shape, seed=nbytes)
    consumer = connector_factory(mode, "decode")
    dst = torch.empty(shape, dtype=getattr(torch, dtype))
    consumer.register(dst)
    got = consumer.consume(handle, dst=dst)
    assert got.tensor is dst
    assert same_bytes(dst, make_tensor(dtype, shape, nbytes))
    assert got.meta == {"seed": nbytes}


@pytest.mark.parametrize("mode", ["p2p", "store"])
def test_every_dtype_into_connector_owned_memory(producer, connector_factory, mode):
    # one producer process and one consumer for all dtypes (a process start-up per
    # dtype cost ~10 s each and tested nothing more)
    shape = (3, 5, 7, 11)
    consumer = connector_factory(mode, "decode")
    for dtype in ("bfloat16", "float16", "float32", "int64"):
        handle = publish(producer, mode, f"r-{dtype}", dtype, shape, seed=3)
        with consumer.consume(handle) as got:
            assert same_bytes(got.tensor, make_tensor(dtype, shape, 3)), dtype


def test_p2p_payload_is_consumed_once_across_consumers(producer, connector_factory):
    handle = publish(producer, "p2p", "r1", "float32", (256,), seed=1)
    first, second = connector_factory("p2p", "decode"), connector_factory("p2p", "decode")
    first.consume(handle).release()
    with pytest.raises(AlreadyConsumedError):
        second.consume(handle)
    stats = producer.request(op="stats")["stats"]["p2p"]
    assert stats["live_publications"] == 0
    assert stats["temporary_registrations"] == 0


def test_store_payload_outlives_its_producer(mooncake_cluster, connector_factory):
    with ProducerProcess(mooncake_cluster.settings) as p:
        handle = publish(p, "store", "r1", "bfloat16", (1, 16, 21, 90, 160), seed=9)
    # the producer process has exited; its bytes wait in the store host
    assert len(mooncake_cluster.keys()) == 1
    consumer = connector_factory("store", "decode")
    with consumer.consume(handle) as got:
        assert same_bytes(got.tensor, make_tensor("bfloat16", (1, 16, 21, 90, 160), 9))
    with pytest.raises(PayloadGoneError):
        connector_factory("store", "decode").consume(handle, timeout=0.5)


def test_shared_store_payload_is_readable_by_many_then_cleaned_up(producer, connector_factory):
    handle = publish(producer, "store", "r1", "float32", (1024,), seed=4, lease="shared")
    readers = [connector_factory("store", "decode") for _ in range(3)]
    for r in readers:
        with r.consume(handle) as got:
            assert same_bytes(got.tensor, make_tensor("float32", (1024,), 4))
    readers[0].cleanup("r1")  # any connector can remove a request's stored objects
    with pytest.raises(PayloadGoneError):
        readers[1].consume(handle, timeout=0.3)


def test_auto_mode_uses_p2p_for_a_ready_consumer_and_store_otherwise(connector_factory):
    prod, cons = connector_factory("auto", "denoise"), connector_factory("auto", "decode")
    x = make_tensor("float32", (4096,), 8)
    direct = prod.publish(StagePayload("r1", "latent", tensor=x), consumer="decode-0")
    relayed = prod.publish(StagePayload("r2", "latent", tensor=x))
    assert direct.handle.transport == "p2p" and relayed.handle.transport == "store"
    for pub in (direct, relayed):
        with cons.consume(pub.wait(10)) as got:
            assert same_bytes(got.tensor, x)


@pytest.mark.parametrize(("same_host", "path"), [(True, "p2p/shm"), (False, "p2p/net")])
def test_same_host_p2p_copies_memory_directly_unless_turned_off(
    producer, mooncake_cluster, same_host, path
):
    handle = publish(producer, "p2p", "r1", "bfloat16", (1, 16, 21, 90, 160), seed=21)
    settings = dataclasses.replace(mooncake_cluster.settings, same_host=same_host)
    consumer = DiffusionConnector("decode", "p2p", settings)
    expected = make_tensor("bfloat16", (1, 16, 21, 90, 160), 21)
    try:
        with consumer.consume(handle) as got:  # into the connector's (shared) receive pool
            assert got.path == path
            assert same_bytes(got.tensor, expected)
        # into the caller's own tensor: process_vm_writev on the same host
        handle = publish(producer, "p2p", "r2", "bfloat16", (1, 16, 21, 90, 160), seed=21)
        dst = torch.empty_like(expected)
        with consumer.consume(handle, dst=dst) as got:
            assert got.path == path and same_bytes(dst, expected)
    finally:
        consumer.close()


def test_chunked_stream_across_processes_lands_chunk_by_chunk(producer, connector_factory):
    for mode in ("p2p", "store"):
        r = producer.request(
            op="publish",
            mode=mode,
            request_id=f"c-{mode}",
            dtype="bfloat16",
            shape=[1, 16, 21, 90, 160],
            seed=22,
            chunk_dim=2,
            num_chunks=7,
        )
        assert r["ok"], r
        consumer = connector_factory(mode, "decode")
        expected = torch.tensor_split(make_tensor("bfloat16", (1, 16, 21, 90, 160), 22), 7, 2)
        with consumer.consume(bytes.fromhex(r["handle"])) as got:
            for chunk in got:
                assert same_bytes(chunk.tensor.contiguous(), expected[chunk.index].contiguous())

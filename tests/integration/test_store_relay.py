"""The pipelined store relay: a consumer reads each chunk when the producer's side
channel says it was committed, and falls back to polling when it cannot say.
Real mooncake_master and store host; producer and consumer are separate connectors."""

import threading
import time

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import StagePayload
from mooncake_diffusion.errors import PayloadGoneError
from mooncake_diffusion.transfer.transports import store as store_transport

pytestmark = pytest.mark.integration


def until(cond, what, timeout=60.0):
    """Wait for a state (not a duration): fails only if it never comes."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.005)


def test_consumer_is_told_each_chunk_as_the_producer_commits_it(connector_factory):
    prod, cons = connector_factory("store", "denoise"), connector_factory("store", "decode")
    buf = torch.zeros(1, 4, 4, 16, 16)
    final = make_tensor("float32", (1, 4, 4, 16, 16), 31)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=2, num_chunks=4), stream=True
    )
    server = prod._transports.get("store")._server
    got = cons.consume(pub.handle)
    until(lambda: server._conns, "the consumer subscribed to the producer's commits")
    for i in range(4):  # nothing is committed before the consumer listens
        buf[:, :, i] = final[:, :, i]
        pub.chunk_ready(i)
        chunk = got.chunk(i, timeout=30)
        assert same_bytes(chunk.tensor.contiguous(), final[:, :, i : i + 1].contiguous())
    assert same_bytes(got.tensor, final)
    got.release()
    pub.wait(10)
    assert cons._transports.get("store").told == 4  # every chunk on a notification


def test_without_the_producer_the_consumer_polls_the_store(connector_factory):
    prod, cons = connector_factory("store", "denoise"), connector_factory("store", "decode")
    x = make_tensor("bfloat16", (1, 4, 6, 16, 16), 32)
    pub = prod.publish(StagePayload("r2", "latent", tensor=x, chunk_dim=2, num_chunks=3))
    pub.wait(30)
    handle = pub.encode()
    prod.close()  # its side channel is gone; the bytes stay in the store
    with cons.consume(handle) as got:
        assert [c.index for c in got] == [0, 1, 2] and same_bytes(got.tensor, x)
    assert cons._transports.get("store").told == 0


def test_a_withdrawn_stream_is_reported_gone_at_once(connector_factory):
    prod, cons = connector_factory("store", "denoise"), connector_factory("store", "decode")
    buf = torch.ones(4, 64)
    pub = prod.publish(
        StagePayload("r3", "latent", tensor=buf, chunk_dim=0, num_chunks=4), stream=True
    )
    server = prod._transports.get("store")._server
    got = cons.consume(pub.handle, timeout=600)  # the producer's word ends it, not this
    until(lambda: server._conns, "the consumer subscribed to the producer's commits")
    pub.chunk_ready(0)
    assert same_bytes(got.chunk(0, timeout=20).tensor, buf[0:1])
    pub.release()  # chunks 1..3 will never come: the producer says so
    with pytest.raises(PayloadGoneError, match="withdrawn by its producer after 1 of 4"):
        got.chunk(1, timeout=60)
    got.release()


def test_chunks_told_while_the_consumer_was_reading_come_in_one_batched_read(
    connector_factory,
):
    prod, cons = connector_factory("store", "denoise"), connector_factory("store", "decode")
    ptrans, ctrans = prod._transports.get("store"), cons._transports.get("store")
    sent: list[int] = []  # ChunkDone indices the producer's side channel has sent
    serve = ptrans._notify

    def counting(req, progress):
        def told(done):
            progress(done)
            sent.append(done.index)

        return serve(req, told)

    ptrans._notify = counting  # before the first publish starts the side channel
    reads: list[int] = []  # objects per consumer read that found everything
    held, go = threading.Event(), threading.Event()
    get_many = ctrans._client.get_many

    def gated(keys, *args, **kw):
        found = get_many(keys, *args, **kw)
        if all(found):
            reads.append(len(keys))
            if len(reads) == 1:  # chunk 0 is read: hold the consumer right here
                held.set()
                assert go.wait(60)
        return found

    ctrans._client.get_many = gated
    buf = torch.zeros(4, 64)
    final = make_tensor("float32", (4, 64), 33)
    pub = prod.publish(
        StagePayload("r4", "latent", tensor=buf, chunk_dim=0, num_chunks=4), stream=True
    )
    got = cons.consume(pub.handle)
    until(lambda: ptrans._server._conns, "the consumer subscribed to the producer's commits")
    buf.copy_(final)
    pub.chunk_ready(0)
    until(held.is_set, "the consumer is reading chunk 0")
    for i in (1, 2, 3):
        pub.chunk_ready(i)
    pub.wait(30)
    until(lambda: sent == [0, 1, 2, 3], "the producer told every commit")
    go.set()
    assert same_bytes(got.tensor, final)
    assert reads == [1, 3]  # chunk 0 alone, then 1-3 in one read
    assert ctrans.told == 4
    got.release()


def test_inner_dim_chunks_move_through_one_scratch_buffer_each(connector_factory, monkeypatch):
    prod, cons = connector_factory("store", "denoise"), connector_factory("store", "decode")
    x = make_tensor("bfloat16", (1, 16, 8, 12, 20), 34)  # a T chunk: 16 byte ranges
    pub = prod.publish(StagePayload("r5", "latent", tensor=x, chunk_dim=2, num_chunks=4))
    pub.wait(30)
    with cons.consume(pub.handle) as got:
        assert [c.index for c in got] == [0, 1, 2, 3] and same_bytes(got.tensor, x)
    for conn in (prod, cons):  # both ends gathered (and kept the buffer for reuse)
        assert conn._transports.get("store")._scratch.idle > 0
    # The object is the same bytes either way: a consumer that reads range by range
    # gets what a gathering producer put.
    pub2 = prod.publish(StagePayload("r6", "latent", tensor=x, chunk_dim=2, num_chunks=4))
    pub2.wait(30)
    monkeypatch.setattr(store_transport, "_GATHER_MAX", 0)
    with cons.consume(pub2.handle) as got:
        assert same_bytes(got.tensor, x)

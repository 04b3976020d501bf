"""The pipelined store relay: a consumer reads each chunk when the producer's side
channel says it was committed, and falls back to polling when it cannot say.
Real mooncake_master and store host; producer and consumer are separate connectors."""

import time

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import StagePayload
from mooncake_diffusion.errors import PayloadGoneError

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

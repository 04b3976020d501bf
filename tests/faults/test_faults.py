"""Dead peers, a dead master, a full pool: typed errors, nothing lost or leaked,
and the connector keeps working afterwards."""

import socket
import threading
import time

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import DiffusionConnector, LocalCluster, MooncakeSettings, StagePayload
from mooncake_diffusion.errors import (
    DeadlineExceededError,
    MasterUnavailableError,
    PeerGoneError,
    StoreFullError,
    TransferError,
)
from mooncake_diffusion.handoff.demo import ProducerProcess
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transfer.sidechannel import SideChannelClient
from mooncake_diffusion.wire.schema import FetchReply, FetchRequest

pytestmark = pytest.mark.faults


def _dead_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens


def test_dead_master_fails_fast_naming_the_address():
    addr = _dead_address()
    settings = MooncakeSettings(master=addr, connect_timeout_s=1.0)
    conn = DiffusionConnector("denoise", "store", settings)
    # Mooncake's own setup() would block ~90 s against a dead master; our probe
    # gives up at connect_timeout_s. Which of the two ended the wait is read off
    # the error (the probe's message, with its bound), not off a clock.
    with pytest.raises(MasterUnavailableError, match=addr) as err:
        conn.publish(StagePayload("r1", "latent", tensor=torch.zeros(4)))
    assert f"no Mooncake master at {addr}" in str(err.value)
    assert "after 1.0s" in str(err.value)
    conn.close()


def test_killed_p2p_producer_is_a_peer_error_and_consumer_goes_on(
    mooncake_cluster, connector_factory
):
    consumer = connector_factory("p2p", "decode")
    p = ProducerProcess(mooncake_cluster.settings)
    r = p.request(op="publish", mode="p2p", request_id="r1", dtype="float32", shape=[1024], seed=1)
    p.kill()
    with pytest.raises(TransferError):  # PeerGoneError or a failed write
        # a peer error, not a deadline: the bound only keeps a loaded machine from
        # turning the one into the other (a dead peer is found in ms idle)
        consumer.consume(bytes.fromhex(r["handle"]), timeout=120)
    with ProducerProcess(mooncake_cluster.settings) as p2:
        r = p2.request(
            op="publish", mode="p2p", request_id="r2", dtype="float32", shape=[1024], seed=2
        )
        with consumer.consume(bytes.fromhex(r["handle"])) as got:
            assert same_bytes(got.tensor, make_tensor("float32", (1024,), 2))


def test_store_pool_full_is_typed_and_leaves_no_keys():
    baseline = {f"{t.name}#{t.ident}" for t in __import__("threading").enumerate()}
    with LocalCluster(pool_bytes=64 << 20) as cluster:
        conn = DiffusionConnector("denoise", "store", cluster.settings)
        too_big = torch.zeros(96 << 20, dtype=torch.uint8)
        with pytest.raises(StoreFullError):
            conn.publish(StagePayload("r1", "latent", tensor=too_big)).wait(30)
        assert cluster.keys() == []
        assert conn.stats().live_publications == 0
        # the same request may publish again once its failed attempt is gone
        ok = make_tensor("float32", (1 << 20,), 5)
        pub = conn.publish(StagePayload("r1", "latent", tensor=ok))
        with conn.consume(pub.wait(30)) as got:
            assert same_bytes(got.tensor, ok)
        conn.close()
        assert_no_leaks(cluster, baseline)


def test_hard_pinned_payloads_are_never_evicted_when_the_pool_fills():
    with LocalCluster(pool_bytes=64 << 20) as cluster:
        conn = DiffusionConnector("denoise", "store", cluster.settings)
        tensors = [make_tensor("uint8", (8 << 20,), i) for i in range(12)]
        handles, refused = [], 0
        for i, t in enumerate(tensors):
            try:
                handles.append(
                    (i, conn.publish(StagePayload(f"r{i}", "latent", tensor=t)).wait(30))
                )
            except StoreFullError:
                refused += 1
        assert refused > 0, "a 64 MiB pool cannot hold 96 MiB"
        for i, h in handles:  # every accepted payload is still there, intact
            with conn.consume(h) as got:
                assert same_bytes(got.tensor, tensors[i])
        assert cluster.keys() == []
        conn.close()


def test_killed_store_host_is_a_peer_error():
    with LocalCluster(pool_bytes=64 << 20) as cluster:
        conn = DiffusionConnector("denoise", "store", cluster.settings)
        pub = conn.publish(StagePayload("r1", "latent", tensor=torch.ones(1024)))
        pub.wait(30)
        cluster.kill_store_host()
        try:
            # a dead store host is a peer error, not a deadline: the generous timeout
            # is only there so a loaded machine cannot turn one into the other
            with pytest.raises((PeerGoneError, TransferError)):
                conn.consume(pub, timeout=120)
        finally:
            conn.close()


def test_reaper_removes_payloads_of_a_dead_producer_after_their_ttl():
    with LocalCluster(pool_bytes=64 << 20, reap_interval_s=0.2) as cluster:
        p = ProducerProcess(cluster.settings)
        kept = p.request(
            op="publish", mode="store", request_id="keep", dtype="float32", shape=[256], seed=1
        )
        gone = p.request(
            op="publish",
            mode="store",
            request_id="lost",
            dtype="float32",
            shape=[256],
            seed=2,
            ttl_s=0.5,
        )
        assert kept["ok"] and gone["ok"]  # both landed in the store
        p.kill()  # the producer dies; nobody will ever consume "lost"
        # (not counted here: on a loaded machine the 0.5 s TTL may already have passed)
        now = cluster.keys()
        assert any(k.startswith("mcd/keep/") for k in now), now
        assert all(k.startswith(("mcd/keep/", "mcd/lost/")) for k in now), now
        deadline = time.monotonic() + 120  # the 0.5 s TTL, then the 0.2 s reaper
        while len(cluster.keys()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        (left,) = cluster.keys()
        assert left.startswith("mcd/keep/")  # no TTL: kept for its consumer
        conn = DiffusionConnector("decode", "store", cluster.settings)
        with conn.consume(bytes.fromhex(kept["handle"])) as got:
            assert same_bytes(got.tensor, make_tensor("float32", (256,), 1))
        conn.close()
        assert cluster.keys() == []


def test_abandoned_p2p_fetch_quarantines_receive_memory(mooncake_cluster, connector_factory):
    prod, cons = connector_factory("p2p", "denoise"), connector_factory("p2p", "decode")
    buf = make_tensor("float32", (4, 1024), 31)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=0, num_chunks=4), stream=True
    )
    # The producer never readies chunks 1-3, so the deadline passes after chunk 0
    # landed whatever it is; 10 s only has to cover chunk 0 on a loaded machine.
    got = cons.consume(pub.handle, timeout=10)  # into the connector's pool
    pub.chunk_ready(0)
    assert same_bytes(got.chunk(0).tensor, buf[0:1])
    with pytest.raises(DeadlineExceededError):  # the producer never finishes in time
        got.wait()
    got.release()
    stats = cons.stats()
    # the producer could still write into that memory: it is not handed out again yet
    assert stats.pool_bytes_quarantined >= buf.nbytes and stats.pool_bytes_in_use == 0
    assert stats.late_write_kept_bytes == 0  # it was all pool memory
    pub.release()


def _none(_: object) -> None:
    pass


def test_p2p_producer_starts_no_chunk_after_the_consumers_deadline(connector_factory):
    """A consumer holds its memory back from its deadline on, so the producer must not
    start a write after it: a chunk readied later is refused and the payload stays
    for another fetch. The consumer here is a bare side-channel client whose budget
    (``FetchRequest.budget_s``) ended a microsecond after the producer received it;
    the chunk is readied only once the producer holds the fetch (its claim seen)."""
    prod = connector_factory("p2p", "denoise")
    buf = make_tensor("float32", (2, 1024), 33)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=0, num_chunks=2), stream=True
    )
    h = pub.handle
    endpoint = h.source.endpoint
    lengths = tuple(t.nbytes for t in h.tensors)
    # never written: a refused chunk goes nowhere (a write would fail on this segment)
    late = FetchRequest(h.payload_id, "127.0.0.1:1", (1,), lengths, budget_s=1e-6)
    client = SideChannelClient(peer_timeout=5.0)
    replies: list[FetchReply] = []
    t = threading.Thread(
        target=lambda: replies.append(client.call(endpoint, late, time.monotonic() + 60, _none))
    )
    t.start()
    probe = SideChannelClient(peer_timeout=5.0)
    deadline = time.monotonic() + 60
    # wrong lengths: answered "mismatch" while nobody holds the payload, never claimed
    seen = FetchRequest(h.payload_id, "", (1,), (1,))
    while probe.call(endpoint, seen, deadline, _none).status != "consumed":  # now held
        assert time.monotonic() < deadline, "the producer never took the fetch"
        time.sleep(0.01)
    pub.chunk_ready(0)
    t.join(60)
    assert [r.status for r in replies] == ["failed"]
    assert "after the consumer's deadline" in replies[0].detail, replies[0].detail
    probe.close()
    client.close()
    pub.chunk_ready(1)
    cons = connector_factory("p2p", "decode")  # the payload is still there, whole
    with cons.consume(h, timeout=30) as got:
        assert same_bytes(got.tensor, buf)
    pub.wait(30)
    pub.release()


@pytest.mark.parametrize("into", ["dst", "outside the pool"])
def test_abandoned_p2p_fetch_keeps_other_memory_alive(mooncake_cluster, connector_factory, into):
    """Memory outside the receive pool that an abandoned fetch wrote into (the
    caller's ``dst``, or a buffer made for a payload larger than the pool) is kept
    alive for the transport's ``late_write_s``: never freed under a late write."""
    prod = connector_factory("p2p", "denoise")
    cons = connector_factory("p2p", "decode", receive_pool_bytes=4096)
    buf = make_tensor("float32", (4, 1024), 32)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=0, num_chunks=4), stream=True
    )
    dst = torch.empty_like(buf) if into == "dst" else None
    got = cons.consume(pub.handle, dst, timeout=10)  # see the test above for the 10 s
    pub.chunk_ready(0)
    assert same_bytes(got.chunk(0).tensor, buf[0:1])
    with pytest.raises(DeadlineExceededError):
        got.wait()
    got.release()
    stats = cons.stats()
    assert stats.late_write_kept_bytes == buf.nbytes
    assert stats.pool_bytes_quarantined == 0 and stats.pool_bytes_in_use == 0
    pub.release()


def test_closing_mid_stream_leaves_no_orphaned_chunks(mooncake_cluster, connector_factory):
    before = set(mooncake_cluster.keys())
    prod = connector_factory("store", "denoise")
    buf = make_tensor("float32", (4, 1024), 41)
    pub = prod.publish(
        StagePayload("r1", "latent", tensor=buf, chunk_dim=0, num_chunks=4), stream=True
    )
    pub.chunk_ready(0)  # one chunk reaches the store, then the producer shuts down
    deadline = time.monotonic() + 10
    while set(mooncake_cluster.keys()) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(set(mooncake_cluster.keys()) - before) == 1
    prod.close()
    assert set(mooncake_cluster.keys()) == before

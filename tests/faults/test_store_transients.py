"""Transient Store faults are absorbed in the product, provoked deterministically.

A master started with a short read lease (``-default_kv_lease_ttl``) makes any
read that takes longer than that fail with ``LEASE_EXPIRED`` (-707): the client
checks the lease, counted from its query, once the transfer is done. Reads of one
64 MiB object run on a master with a 1 ms lease: no copy of 64 MiB fits in it
(that is 64 GB/s), so an unsplit read fails every time. A 20 ms lease is not
enough for that: over loopback TCP on a 2-vCPU machine a 64 MiB read took 12 ms
at best (40 ms typical). Payloads in 1 MiB parts are read on a master with a
20 ms lease, part by part, and a part that still outlives its lease on a loaded
machine is retried within the consume deadline. A consume that fails leaves the
payload for a retry, and its TTL still reaps it. The readers here read over the
network (``same_host`` off).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import time

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import DiffusionConnector
from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion._mooncake.master import MasterProcess
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import (
    MasterUnavailableError,
    PayloadGoneError,
    TransientStoreError,
)
from mooncake_diffusion.handoff.demo import ProducerProcess
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.faults

MB = 1 << 20
SHAPE = (64 * MB // 4 // 256, 256)  # 64 MiB of float32


#: the masters' read leases (ms), by the test's ``lease_ms`` mark
LEASES = {1: "instant_lease", 20: "short_lease"}


@pytest.fixture(scope="module")
def instant_lease():
    """A cluster whose master grants 1 ms read leases; reaps every 0.2 s."""
    with LocalCluster(pool_bytes=512 * MB, lease_ttl_ms=1, reap_interval_s=0.2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def short_lease():
    """A cluster whose master grants 20 ms read leases; reaps every 0.2 s."""
    with LocalCluster(pool_bytes=512 * MB, lease_ttl_ms=20, reap_interval_s=0.2) as cluster:
        yield cluster


@pytest.fixture
def clean(request):
    """The cluster named by the test's ``lease_ms`` mark, leak-checked after the test."""
    lease = request.node.get_closest_marker("lease_ms").args[0]
    cluster = request.getfixturevalue(LEASES[lease])
    baseline = thread_names()
    yield cluster
    assert_no_leaks(cluster, baseline, timeout=15)


@pytest.fixture
def producer(clean, request):
    """A producer process whose settings split store objects at the test's ``part_bytes``
    mark (bytes; 0: never split); it stays up while the test consumes."""
    part = request.node.get_closest_marker("part_bytes").args[0]
    with ProducerProcess(dataclasses.replace(clean.settings, store_part_bytes=part)) as p:
        yield p


def over_the_network(settings, **changes):
    """``settings`` with ``changes``, reading the store over the network."""
    return dataclasses.replace(settings, same_host=False, **changes)


def publish(producer, request_id: str, **kw) -> bytes:
    """Publish 64 MiB (delete-on-consume) from the producer process; the handle."""
    r = producer.request(
        op="publish",
        mode="store",
        request_id=request_id,
        dtype="float32",
        shape=list(SHAPE),
        seed=7,
        **kw,
    )
    assert r["ok"], r
    return bytes.fromhex(r["handle"])


@pytest.mark.lease_ms(1)
def test_an_unsplit_read_outlives_a_short_lease_every_time(clean):
    """The fault is real and provoked on purpose: 64 MiB in one read, 1 ms lease. Each
    read fails, and it is retried until the deadline, then raised. The deadline is read
    off a clock that ticks one second per reading (not the wall, which a loaded machine
    stretches past any bound): with ``store_retry_s=2.5`` the call makes exactly three
    reads, however long each takes."""
    settings = over_the_network(clean.settings, store_part_bytes=0, store_retry_s=2.5)
    client = StoreClient(settings, clock=itertools.count().__next__)
    src, dst = make_tensor("float32", SHAPE, 1), torch.zeros(SHAPE, dtype=torch.float32)
    regions = [describe("src", src)[1], describe("dst", dst)[1]]
    try:
        for r in regions:
            client.regs.pin(r)
        client.put_many(["t/unsplit"], [[src.data_ptr()]], [[src.nbytes]], pin="hard")
        with pytest.raises(TransientStoreError, match="LEASE_EXPIRED"):
            client.get_many(["t/unsplit"], [[dst.data_ptr()]], [[dst.nbytes]])
        assert client.retries == 2  # read at t+0, retried at t+1 and t+2; t+3 is past it
    finally:
        client.remove_many(["t/unsplit"])
        for r in regions:
            client.regs.unpin(r)
        client.close()


@pytest.mark.lease_ms(20)
@pytest.mark.part_bytes(1 * MB)
def test_a_payload_in_parts_crosses_a_short_lease(clean, producer):
    """The reader's own batch limit (64 MiB) puts all 64 parts in one batched read,
    whose keys share one lease grant: it mostly outlives the 20 ms lease (64 MiB took
    12-45 ms here). The parts that failed are retried one per read, each under a
    lease of its own, so the consume completes however loaded the machine is."""
    handle = publish(producer, "split")
    keys = clean.keys()
    assert sum(k.startswith("mcd/split/") for k in keys) == 64  # 64 parts of 1 MiB
    reader = over_the_network(clean.settings, store_part_bytes=64 * MB)
    conn = DiffusionConnector("decode", "store", reader)
    try:
        dst = torch.empty(SHAPE, dtype=torch.float32)
        conn.register(dst)
        conn.consume(handle, dst=dst, timeout=60).release()
        assert same_bytes(dst, make_tensor("float32", SHAPE, 7))
    finally:
        conn.close()
    assert clean.keys() == []  # delete-on-consume removed every part


@pytest.mark.lease_ms(1)
@pytest.mark.part_bytes(0)
def test_a_failed_consume_leaves_the_payload_and_its_ttl_still_reaps_it(clean, producer):
    """The TTL (30 s) must outlast publishing and the failed consume (one 64 MiB read,
    about 11 s at load average 30): that is the one wall-time bound here, with a
    margin of about 3x. Its reaping is then waited for by condition (up to 180 s)."""
    handle = publish(producer, "doomed", ttl_s=30)
    keys = clean.keys()
    assert len(keys) == 1
    settings = over_the_network(clean.settings, store_retry_s=0.5)
    conn = DiffusionConnector("decode", "store", settings)
    try:
        with pytest.raises(TransientStoreError):
            conn.consume(handle, timeout=2)  # every read of the one 64 MiB object expires
        assert clean.keys() == keys  # still there for a consumer that can read it
        assert conn.stats().pool_bytes_in_use == 0  # nothing of it kept on this side
    finally:
        conn.close()
    deadline = time.monotonic() + 180  # the 30 s TTL, then the 0.2 s reaper
    while clean.keys() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert clean.keys() == []


def test_a_dead_master_is_not_retried_until_the_deadline():
    """A failed master RPC is retried only while the master answers: once it is dead,
    the probe after the first failure ends the call with ``MasterUnavailableError``
    (without the probe it would retry for the whole 600 s deadline and then raise
    ``TransientStoreError``)."""
    baseline = thread_names()
    master = MasterProcess()
    settings = dataclasses.replace(master.start(), store_retry_s=600.0)
    client = StoreClient(settings)
    try:
        assert client.exists_many(["t/absent"]) == [False]
        assert client.master_probes == 0  # a healthy call probes nothing
        os.killpg(master.proc.pid, signal.SIGKILL)
        master.proc.wait()
        with pytest.raises(MasterUnavailableError, match=settings.master.rsplit(":", 1)[1]):
            client.exists_many(["t/absent"])
        assert (client.master_probes, client.master_down) == (1, 1)
    finally:
        client.close()
        master.stop()
    assert_no_leaks(None, baseline, timeout=15)


@pytest.mark.lease_ms(20)
@pytest.mark.part_bytes(0)
def test_a_committed_payload_that_is_gone_fails_at_once_not_at_its_deadline(clean, producer):
    """A stage's acknowledged input is fully published, so absent means gone: with
    ``committed=True`` the consume says so at once instead of polling for an hour."""
    handle = publish(producer, "vanished")
    clean.clear()  # as if it died with its store host
    conn = DiffusionConnector("decode", "store", clean.settings)
    try:
        with pytest.raises(PayloadGoneError, match="gone from the store"):
            conn.consume(handle, timeout=3600, committed=True)
        assert conn.stats().pool_bytes_in_use == 0
    finally:
        conn.close()

"""Mooncake master HA on a real etcd: two ``mooncake_master -enable_ha`` (separate
processes), a store host and our ``StoreClient`` given ``etcd://...`` as master.
The leader is SIGKILLed with objects in the store; the standby takes over and the
same clients carry on without being rebuilt. With ``-enable_oplog`` every object
whose put's OpLog entry had reached etcd is found again (the leader writes those
entries in the background, so the kill waits for them: a put that completed just
before it may be lost); without it the new leader starts empty (what
``docs/deployment.md`` says, measured here on every run)."""

from __future__ import annotations

import time

import pytest
import torch

from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion._mooncake.master_view import (
    leader_rpc_address,
    master_view_key,
    oplog_puts,
)
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import StoreFullError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.etcd import EtcdCluster
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration

MIB = 1 << 20
KEYS = [f"ha-{i}" for i in range(6)]
#: longer than Mooncake's takeover (5 s lease + 5 s warm-up) on a loaded machine
TAKEOVER_S = 60.0


@pytest.fixture(scope="module")
def etcd():
    """One etcd for the module: Mooncake's client keeps one etcd per process."""
    with EtcdCluster(1) as cluster:
        yield cluster
    assert EtcdCluster.live() == [], "etcd members left running"


@pytest.fixture(params=[True, False], ids=["oplog", "no-oplog"])
def ha(request, etcd, monkeypatch):
    """(cluster with 2 HA masters, its etcd, oplog on?) torn down with leak checks;
    each under a cluster id of its own (``MC_STORE_CLUSTER_ID``)."""
    threads = thread_names()
    cluster_id = f"mcd_ha_{int(request.param)}_{time.monotonic_ns()}"
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", cluster_id)
    cluster = LocalCluster(64 * MIB, masters=2, etcd_endpoints=etcd.endpoints, oplog=request.param)
    with cluster:
        assert etcd.get_prefix(master_view_key(cluster_id)), "the leader key is where we read it"
        yield cluster, etcd, request.param
        assert cluster.keys() == [], "store keys left behind"
    assert_no_leaks(None, threads)


def _eventually(attempt, deadline: float) -> None:
    """Call ``attempt`` until it returns neither ``False`` nor raises
    ``StoreFullError``; the last try's outcome stands past ``deadline``."""
    while True:
        try:
            if attempt() is not False:
                return
        except StoreFullError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "not done within the takeover deadline"
        time.sleep(0.2)


def test_store_clients_follow_the_leader_across_a_master_kill(ha):
    cluster, etcd, oplog = ha
    settings = cluster.settings
    assert settings.master == "etcd://" + etcd.endpoints[0]
    first = leader_rpc_address(settings.master)
    client = StoreClient(settings)
    buf = torch.zeros(len(KEYS) * MIB, dtype=torch.uint8)
    client.regs.pin(describe("b", buf)[1])
    try:
        for i in range(len(KEYS)):
            buf[i * MIB : (i + 1) * MIB] = i + 1
        ptrs = [[buf.data_ptr() + i * MIB] for i in range(len(KEYS))]
        sizes = [[MIB]] * len(KEYS)
        client.put_many(KEYS, ptrs, sizes, pin="hard")
        want = buf.clone()
        if oplog:  # the kill lands once the OpLog in etcd holds every put
            held = time.monotonic() + TAKEOVER_S
            _eventually(lambda: oplog_puts(settings.master) >= set(KEYS), held)

        assert cluster.masters is not None
        cluster.masters.kill_leader()
        cluster.masters.wait_leader(TAKEOVER_S)
        assert leader_rpc_address(settings.master) not in (None, first)

        # the same client writes and reads through the new leader, once the store
        # host has re-mounted its segment there (until then a put finds no room)
        deadline = time.monotonic() + TAKEOVER_S
        _eventually(
            lambda: client.put_many(["ha-after"], [ptrs[0]], [sizes[0]], pin="hard"), deadline
        )
        assert client.get_many(["ha-after"], [ptrs[1]], [sizes[1]]) == [True]

        buf.zero_()
        if oplog:  # the OpLog carried every completed put to the new leader
            _eventually(lambda: client.get_many(KEYS, ptrs, sizes) == [True] * len(KEYS), deadline)
            assert torch.equal(buf, want)
        else:  # the new leader starts with no metadata: every object is a miss
            assert client.get_many(KEYS, ptrs, sizes) == [False] * len(KEYS)
        client.remove_many(["ha-after", *(KEYS if oplog else [])])
    finally:
        client.regs.unpin(describe("b", buf)[1])
        client.close()

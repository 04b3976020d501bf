"""Orchestrator leader election on a real etcd (``orchestrator/ha/election.py``): the
leader is a separate process, SIGKILLed; the standby takes over with a higher
fencing token and finds the journal the dead leader committed. A leader that kept
running but lost its lease (it stopped renewing, as behind a partition) can
append nothing once another leads. Takeover times are measured in
``bench/ha.py``, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mooncake_diffusion.orchestrator.ha.election import Candidate
from mooncake_diffusion.platform.etcd import EtcdClient, EtcdCluster
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration

TTL_S = 3

_LEADER = textwrap.dedent(
    """
    import json, sys, time
    from mooncake_diffusion.platform.etcd import EtcdClient
    from mooncake_diffusion.orchestrator.ha.election import Candidate
    me = Candidate(EtcdClient(sys.argv[1].split(",")), "/t/orch", "child", ttl_s=int(sys.argv[2]))
    token = me.campaign(timeout=60)
    assert me.append([b"a1", b"a2"])
    print(json.dumps({"token": token}), flush=True)
    while me.renew():
        time.sleep(me.ttl_s / 3)
    """
)


@pytest.fixture
def etcd():
    threads = thread_names()
    with EtcdCluster(1) as cluster:
        yield EtcdClient(cluster.endpoints)
    assert EtcdCluster.live() == [], "etcd members left running"
    assert_no_leaks(None, threads)


def test_a_standby_takes_over_from_a_killed_leader_with_its_journal(etcd):
    child = subprocess.Popen(
        [sys.executable, "-c", _LEADER, ",".join(etcd.endpoints), str(TTL_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        old = json.loads(child.stdout.readline())["token"]
        with Candidate(etcd, "/t/orch", "standby", ttl_s=TTL_S) as standby:
            with pytest.raises(TimeoutError):  # the leader renews: no way in
                standby.campaign(timeout=0.5)
            child.kill()
            child.wait()
            token = standby.campaign(timeout=60)
            assert token > old
            assert standby.entries() == [b"a1", b"a2"]
            assert standby.append([b"b1"])
            assert standby.entries() == [b"a1", b"a2", b"b1"]
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_a_deposed_leader_can_append_nothing(etcd):
    with (
        Candidate(etcd, "/t/orch", "old", ttl_s=TTL_S) as old,
        Candidate(etcd, "/t/orch", "new", ttl_s=TTL_S) as new,
    ):
        first = old.campaign(timeout=30)
        assert old.append([b"before"])
        # old stops renewing (cut off): its lease lapses and new takes the key
        second = new.campaign(timeout=60)
        assert second > first
        assert not old.append([b"fenced"])  # the guard on its term fails
        assert not old.renew()
        assert new.append([b"after"])
        assert new.entries() == [b"before", b"after"]

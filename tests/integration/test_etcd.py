"""The etcd helper (``mooncake_diffusion.platform.etcd``) on real etcd processes: one member
answers reads and writes through the v3 gateway; three members keep taking writes
after their Raft leader is SIGKILLed and stop when quorum is lost; nothing is left
running afterwards."""

from __future__ import annotations

import contextlib
import socket

import pytest

from mooncake_diffusion.platform.etcd import EtcdCluster, EtcdUnavailableError, prefix_end
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration


@pytest.fixture
def no_leaks():
    threads = thread_names()
    yield
    assert EtcdCluster.live() == [], "etcd members left running"
    assert_no_leaks(None, threads)


def test_prefix_end_is_the_first_key_past_the_prefix():
    assert prefix_end("a/") == b"a0"
    assert prefix_end("a\xff") == b"a\xc3\xc0"  # U+00FF is C3 BF in UTF-8
    assert prefix_end("") == b"\0"


def test_one_member_reads_and_writes(no_leaks):
    with EtcdCluster(1) as etcd:
        etcd.put("t/a", "1")
        etcd.put("t/b", "2")
        etcd.put("u/c", "3")
        assert etcd.get_prefix("t/") == {"t/a": b"1", "t/b": b"2"}
        assert etcd.client().get("u/c") == b"3"
        assert etcd.client().get("u/none") is None
        assert len(EtcdCluster.live()) == 1


def test_a_member_whose_port_was_taken_makes_the_cluster_start_again(no_leaks):
    """Ports are found free, then bound by etcd: another process may take one in
    between. Here one member's client port is taken before the start: that member
    exits, and the cluster starts once more on fresh ports and takes writes."""
    etcd = EtcdCluster(3)
    with contextlib.ExitStack() as stack:
        stack.callback(etcd.close)  # its data directory, even if the squat fails
        squatter = stack.enter_context(socket.socket())
        squatter.bind((etcd.host, etcd.members[1].client_port))
        squatter.listen()
        taken = etcd.members[1].client_port
        with etcd:
            assert etcd.members[1].client_port != taken
            ports = [p for m in etcd.members for p in (m.client_port, m.peer_port)]
            assert len(set(ports)) == len(ports)
            etcd.put("s/a", "1")
            assert etcd.get_prefix("s/") == {"s/a": b"1"}


def test_three_members_survive_the_leader_and_not_quorum_loss(no_leaks):
    with EtcdCluster(3) as etcd:
        etcd.put("q/before", "1")
        leader = etcd.leader()
        etcd.kill(leader)
        etcd.wait_ready(30.0)  # the two left elect a leader and take writes
        etcd.put("q/after", "2")
        assert etcd.get_prefix("q/") == {"q/before": b"1", "q/after": b"2"}
        assert etcd.leader() != leader
        etcd.kill(etcd.leader())  # one of three left: no quorum, no write
        with pytest.raises(EtcdUnavailableError):
            etcd.put("q/lost", "3", timeout=1.0)
        etcd.restart(leader)  # two of three again: writes resume
        etcd.wait_ready(30.0)
        assert etcd.get_prefix("q/")["q/after"] == b"2"

"""Where workers and clients find the orchestrator leader (``follow.py``): the
``etcd://`` address, and a fixed endpoint that never moves. The leader-following
itself, on a real etcd, is in ``tests/integration/test_orchestrator_ha.py``."""

from __future__ import annotations

import pytest
import zmq

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.orchestrator.link.follow import DEFAULT_PREFIX, Follower, LeaderAddress
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.unit


def test_an_etcd_address_names_its_members_and_prefix():
    where = LeaderAddress.parse("etcd://10.0.0.1:2379,10.0.0.2:2379/team/orch/")
    assert where.etcd.endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert where.key == "/team/orch/leader"
    assert LeaderAddress.parse("etcd://e:2379").key == f"{DEFAULT_PREFIX}/leader"


@pytest.mark.parametrize("bad", ["tcp://127.0.0.1:7422", "etcd://", "etcd:///prefix"])
def test_a_bad_etcd_address_is_refused(bad):
    with pytest.raises(ConfigError):
        LeaderAddress.parse(bad)


def test_a_fixed_endpoint_is_connected_once_and_never_moves():
    threads = thread_names()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    follow = Follower("tcp://127.0.0.1:1")
    try:
        assert follow.address == "tcp://127.0.0.1:1"
        assert follow.sync(sock) is False  # the first connection is not a move
        assert follow.sync(sock) is False
    finally:
        follow.close()
        sock.close()
        ctx.term()
    assert_no_leaks(None, threads)  # no watcher thread for a fixed endpoint

"""A p2p producer whose host is cut off is given up within ``peer_timeout``, with
``PeerGoneError`` (the consuming stage then reports its input lost), never waited
for until the fetch's deadline; a producer that is only slow is waited for.

Real sockets across network namespaces (``hosts.py``): the producer
(``silent_producer.py``) holds a fetch after telling its first chunk, and its
host's link goes down there, so the fault lands mid-transfer every time."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hosts import Hosts, available

from mooncake_diffusion.errors import PeerGoneError
from mooncake_diffusion.transfer.sidechannel import SideChannelClient
from mooncake_diffusion.wire.schema import FetchRequest

pytestmark = pytest.mark.chaos

HERE = Path(__file__).resolve().parent
#: far beyond the peer timeout: reaching it would mean the producer was waited for
DEADLINE_S = 60.0


def _call(
    client: SideChannelClient,
    endpoint: str,
    payload_id: str,
    within: float = DEADLINE_S,
    told: Callable[[object], None] = lambda _: None,
) -> str:
    """Fetch ``payload_id`` with a deadline ``within`` seconds away; the reply's status."""
    req = FetchRequest(payload_id, "consumer", (0,), (0,))
    return client.call(endpoint, req, time.monotonic() + within, told).status


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def producer(tmp_path):
    why = available()
    if why is not None:
        pytest.skip(f"chaos tier not run: {why}")
    with Hosts(["prod"], str(tmp_path)) as net:
        env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        p = net.spawn(
            "prod", [sys.executable, str(HERE / "silent_producer.py"), net.ip("prod")], env
        )
        endpoint = p.wait_for("serving ", timeout=60).split("serving ", 1)[1].split()[0]
        yield net, endpoint
        p.stop()


def test_cut_off_producer_is_given_up(producer):
    net, endpoint = producer
    before = _fds()
    client = SideChannelClient(peer_timeout=1.0)
    assert _call(client, endpoint, "ok") == "ok"
    # silent for 3x the peer timeout, but alive: its kernel answers, it is waited for
    assert _call(client, endpoint, "slow") == "ok"

    told = threading.Event()
    raised: list[BaseException] = []

    def fetch() -> None:
        try:
            _call(client, endpoint, "hold", told=lambda _: told.set())
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=fetch)
    t.start()
    assert told.wait(30), "the producer never told its first chunk"
    net.partition("prod")  # mid-transfer: chunk 0 told, the producer holds the rest
    t.join(DEADLINE_S)
    assert not t.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], PeerGoneError), raised

    # a fresh connection to the cut-off host: no answer to the handshake either
    # (or, once the neighbour entry failed, "no route to host" at once)
    with pytest.raises(PeerGoneError):
        _call(client, endpoint, "ok")

    net.heal("prod")  # reachable again once the neighbour entry is refreshed
    deadline = time.monotonic() + 30
    while True:
        try:
            assert _call(client, endpoint, "ok") == "ok"
            break
        except PeerGoneError:  # "no route to host" until then
            assert time.monotonic() < deadline, "the healed producer stayed unreachable"
            time.sleep(0.2)
    client.close()
    assert _fds() == before  # every connection the client made is closed

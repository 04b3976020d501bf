"""One turn of the service's driver takes worker frames until none is left, the cap,
or an API call is posted (``service.take_frames``, ``Inbox.waiting``): a burst of
worker traffic delays an API call by the frame in hand, not by the burst. Real
ZeroMQ sockets (inproc: a message sent is readable when ``send`` returns)."""

from __future__ import annotations

import pytest
import zmq

from mooncake_diffusion.orchestrator.link.inbox import Inbox
from mooncake_diffusion.orchestrator.service.service import take_frames

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    """(worker DEALER, service ROUTER) over inproc, closed at teardown."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    router.bind("inproc://turn")
    dealer.connect("inproc://turn")
    try:
        yield dealer, router
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


def send(dealer: zmq.Socket, n: int) -> None:
    for i in range(n):
        dealer.send(b"frame-%d" % i)


def test_a_turn_takes_every_frame_when_no_call_waits(pair):
    dealer, router = pair
    send(dealer, 10)
    got: list[bytes] = []
    assert take_frames(router, lambda m: got.append(m[1]), lambda: False, 64) == 10
    assert got == [b"frame-%d" % i for i in range(10)]
    assert take_frames(router, got.append, lambda: False, 64) == 0  # none left: no wait


def test_a_turn_stops_at_the_cap_and_the_next_turn_goes_on(pair):
    dealer, router = pair
    send(dealer, 10)
    got: list[bytes] = []
    assert take_frames(router, lambda m: got.append(m[1]), lambda: False, 4) == 4
    assert take_frames(router, lambda m: got.append(m[1]), lambda: False, 64) == 6
    assert got == [b"frame-%d" % i for i in range(10)]


def test_a_posted_call_ends_the_turn_after_the_frame_in_hand(pair):
    dealer, router = pair
    send(dealer, 40)
    inbox: Inbox[str] = Inbox()
    try:
        got: list[bytes] = []

        def handle(msg: list[bytes]) -> None:
            got.append(msg[1])
            if len(got) == 3:
                inbox.put("submit")  # an API call arrives while the third frame is handled

        assert not inbox.waiting()
        assert take_frames(router, handle, inbox.waiting, 64) == 3
        assert inbox.waiting()
        assert list(inbox.drain()) == ["submit"]
        assert not inbox.waiting()
        # the rest of the burst is still there, in order, for the next turn
        assert take_frames(router, lambda m: got.append(m[1]), inbox.waiting, 64) == 37
        assert got == [b"frame-%d" % i for i in range(40)]
    finally:
        inbox.close()


def test_a_call_already_waiting_still_lets_one_frame_through(pair):
    """Frames are never starved: a turn takes at least one when one is ready."""
    dealer, router = pair
    send(dealer, 5)
    got: list[list[bytes]] = []
    assert take_frames(router, got.append, lambda: True, 64) == 1
    assert len(got) == 1 and got[0][1] == b"frame-0"
    assert len(got[0]) == 2  # the routing id, then the frame: the handler checks the shape

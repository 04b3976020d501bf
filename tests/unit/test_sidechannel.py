"""The side channel's client: which error a failed exchange becomes, when a reused
connection is replaced, and the kernel's watch on a connection.

The error mapping runs over a scripted socket (pure logic: what ``recv`` raised, what
the client makes of it); the watch over a real loopback connection. A producer really
cut off is ``tests/chaos/test_peer_gone.py``'s (network namespaces)."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

import pytest

from mooncake_diffusion.errors import DeadlineExceededError, PeerGoneError
from mooncake_diffusion.transfer.sidechannel import (
    SideChannelClient,
    connect,
    recv_frame,
    send_frame,
)
from mooncake_diffusion.wire.schema import ChunkDone, FetchRequest, encode

pytestmark = pytest.mark.unit

#: nothing listens here: a fresh connection is refused at once
REFUSED = "127.0.0.1:1"


class _Scripted:
    """A pooled connection whose answer is ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.closed = False

    def settimeout(self, _: float) -> None:
        pass

    def sendall(self, _: bytes) -> None:
        pass

    def recv(self, _: int) -> bytes:
        raise self.error

    def close(self) -> None:
        self.closed = True


def _call_on(error: BaseException) -> tuple[BaseException, _Scripted]:
    client = SideChannelClient(peer_timeout=1.0)
    sock = _Scripted(error)
    client._idle[REFUSED] = [sock]  # type: ignore[list-item]
    with pytest.raises((PeerGoneError, DeadlineExceededError)) as got:
        client.call(REFUSED, FetchRequest("p", "s", (), ()), float("inf"), lambda _: None)
    client.close()
    return got.value, sock


def test_a_producer_the_kernel_gave_up_is_gone_and_not_dialled_again():
    err, sock = _call_on(TimeoutError(errno.ETIMEDOUT, "Connection timed out"))
    assert isinstance(err, PeerGoneError) and "acknowledged nothing" in str(err)
    assert sock.closed


def test_a_stale_pooled_connection_is_replaced_once():
    for error in (ConnectionResetError(errno.ECONNRESET, "reset"), BrokenPipeError()):
        err, sock = _call_on(error)
        # the fresh connection was tried: refused, which is what it reports
        assert isinstance(err, PeerGoneError) and "unreachable" in str(err), err
        assert sock.closed


def test_the_callers_deadline_is_a_deadline():
    err, sock = _call_on(TimeoutError("timed out"))  # a socket timeout: errno None
    assert isinstance(err, DeadlineExceededError)
    assert sock.closed


def test_a_consumer_that_gives_up_mid_answer_closes_the_connection():
    """``on_progress`` raising (the consumer gave up on the fetch) ends the exchange:
    the error reaches the caller as it was, and the connection is closed at once
    (not pooled, not left to the collector while the traceback lives), so the
    producer, a real loopback peer here, reads the end of it."""
    before = len(os.listdir("/proc/self/fd"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()
        client = SideChannelClient(peer_timeout=30.0)

        def give_up(_: ChunkDone) -> None:
            raise RuntimeError("the consumer gave up")

        answered = threading.Event()
        seen: dict[str, bytes | None] = {}

        def produce() -> None:
            conn, _ = server.accept()
            with conn:
                recv_frame(conn)
                send_frame(conn, encode(ChunkDone(0)))
                answered.set()
                conn.settimeout(60.0)  # hang guard only: a close is read at once
                try:
                    seen["after"] = conn.recv(1)
                except TimeoutError:
                    seen["after"] = None

        producer = threading.Thread(target=produce)
        producer.start()
        with pytest.raises(RuntimeError, match="the consumer gave up") as got:
            deadline = time.monotonic() + 60.0  # hang guard only
            client.call(f"{host}:{port}", FetchRequest("p", "s", (), ()), deadline, give_up)
        producer.join(90.0)
        assert not producer.is_alive()
        assert answered.is_set()
        assert seen["after"] == b"", "the producer's peer did not close the connection"
        assert got.value is not None and not client._idle
        client.close()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("peer_timeout", [0.5, 3.0, 300.0, 86400.0])
def test_a_connection_is_watched_for_any_peer_timeout(peer_timeout):
    before = len(os.listdir("/proc/self/fd"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()
        sock = connect(f"{host}:{port}", float("inf"), peer_timeout)
        with sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            user = getattr(socket, "TCP_USER_TIMEOUT", None)
            if user is not None:
                got = sock.getsockopt(socket.IPPROTO_TCP, user)
                assert got == round(peer_timeout * 1000)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_peer_timeout_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="peer_timeout"):
        SideChannelClient(peer_timeout=bad)

"""The p2p side channel: a consumer asks the producer to write a payload into it.

Each request and reply is framed as a 4-byte big-endian length plus a
``schema`` message (msgpack, versioned; never pickle). Connections persist:
the client keeps idle ones per producer, the server runs one thread per
connection; ``close()`` on either side ends them and joins every thread.

A consumer's connection is watched by the kernel (``_watch_peer``): a producer
that acknowledges nothing, not even a keepalive probe, for ``peer_timeout`` seconds
(callers pass ``MooncakeSettings.peer_timeout_s``; its host crashed, or the network
cut it off) is given up with ``PeerGoneError`` (``DeadlineExceededError`` if the
fetch's own deadline comes first), so the consumer's stage reports its input lost
instead of waiting the deadline out. A producer that is slow but alive answers the
probes from its kernel and is waited for until the deadline.
"""

from __future__ import annotations

import contextlib
import errno
import math
import socket
import struct
import threading
import time
from collections.abc import Callable

from mooncake_diffusion.errors import DeadlineExceededError, HandleError, PeerGoneError
from mooncake_diffusion.platform.settings import split_address
from mooncake_diffusion.wire.schema import (
    ChunkDone,
    FetchReply,
    FetchRequest,
    decode_message,
    encode,
)

__all__ = ["SideChannelClient", "SideChannelServer", "connect", "recv_frame", "send_frame"]

_MAX_FRAME = 1 << 20
_HEADER = struct.Struct(">I")


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, limit: int = _MAX_FRAME) -> bytes:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > limit:
        raise HandleError(f"frame of {n} bytes exceeds {limit}")
    return _recv_exact(sock, n)


def send_frame(sock: socket.socket, data: bytes) -> None:
    """One length-prefixed frame (for callers that run their own exchange)."""
    _send(sock, data)


def recv_frame(sock: socket.socket, limit: int = _MAX_FRAME) -> bytes:
    """One frame; ``ConnectionError`` when the peer closed, ``HandleError`` if over
    ``limit`` bytes (default the side channel's 1 MiB)."""
    return _recv(sock, limit)


def connect(endpoint: str, deadline: float, peer_timeout: float) -> socket.socket:
    """A fresh TCP_NODELAY connection to ``endpoint``, watched (``_watch_peer``); raises
    ``PeerGoneError`` (refused, or no answer within ``peer_timeout``) or
    ``DeadlineExceededError`` (``deadline``, ``time.monotonic()``, came first)."""
    return _connect(endpoint, deadline, peer_timeout)


def _watch_peer(sock: socket.socket, peer_timeout: float) -> None:
    """Have the kernel give ``sock`` up (``ETIMEDOUT`` on the next call) once its peer
    acknowledged nothing for ``peer_timeout`` seconds: keepalive probes every second
    while the connection is idle, and ``TCP_USER_TIMEOUT`` for data sent and never
    acknowledged (on Linux it decides alone once set; the probe count is for platforms
    without it). Options this platform lacks are left unset (Linux has them all)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", 1),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", min(127, max(1, math.ceil(peer_timeout)))),  # Linux caps it
        ("TCP_USER_TIMEOUT", max(1, round(peer_timeout * 1000))),
    ):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class _Closed(PeerGoneError):
    """The producer closed or reset the connection (``PeerGoneError`` to callers)."""


class SideChannelServer:
    """Serves ``FetchRequest``s with ``handler``, one thread per consumer connection.

    Connections are persistent: a consumer reuses one for many fetches, so a
    fetch costs one round trip and no connection set-up. ``handler(request,
    progress)`` runs on the connection's thread, may block (it performs the
    transfer) and calls ``progress(ChunkDone(i))`` as each chunk lands; its
    ``FetchReply`` ends the exchange.
    """

    def __init__(
        self,
        host: str,
        handler: Callable[[FetchRequest, Callable[[ChunkDone], None]], FetchReply],
    ) -> None:
        self._handler = handler
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.25)
        self.endpoint = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="mcd-p2p-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(
                target=self._serve, args=(conn,), name="mcd-p2p-serve", daemon=True
            )
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._conns[conn] = t
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    data = _recv(conn)
                except (OSError, ConnectionError, HandleError):
                    return  # closed by the consumer, by close(), or a broken frame
                try:
                    msg = decode_message(data)
                    if isinstance(msg, FetchRequest):
                        reply = self._handler(msg, lambda done: _send(conn, encode(done)))
                    else:
                        reply = FetchReply("failed", "expected a FetchRequest")
                except HandleError as e:
                    reply = FetchReply("failed", f"bad request: {e}")
                except OSError:
                    return  # the consumer went away mid-transfer
                try:
                    _send(conn, encode(reply))
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def close(self) -> None:
        """Stop accepting, end every connection after its current request, join all
        threads. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._sock.close()
        self._thread.join()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):  # wakes the blocked recv; replies still go out
                conn.shutdown(socket.SHUT_RD)
        for t in conns.values():
            t.join()


class SideChannelClient:
    """A consumer's connections to producers, kept open and reused.

    Thread-safe: each call takes an idle connection to the endpoint or opens
    one, so concurrent fetches never share a socket.
    """

    _IDLE_MAX = 4  # idle connections kept per producer

    def __init__(self, peer_timeout: float) -> None:
        if not (peer_timeout > 0 and math.isfinite(peer_timeout)):
            raise ValueError(f"peer_timeout must be > 0 and finite, got {peer_timeout!r}")
        self.peer_timeout = peer_timeout
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def call(
        self,
        endpoint: str,
        request: FetchRequest,
        deadline: float,
        on_progress: Callable[[ChunkDone], None],
    ) -> FetchReply:
        """Send ``request``, pass each ``ChunkDone`` to ``on_progress`` and return the
        final reply, all before ``deadline`` (``time.monotonic()``); raises
        ``PeerGoneError`` (unreachable, closed, or silent for ``peer_timeout``) or
        ``DeadlineExceededError``.

        A reused connection that turns out closed before any answer (the
        producer restarted or dropped it) is replaced once by a fresh one; one the
        kernel gave up (a silent producer) is not: that producer is gone.
        """
        with self._lock:
            idle = self._idle.get(endpoint)
            sock = idle.pop() if idle else None
        if sock is not None:
            progressed = False

            def seen(done: ChunkDone) -> None:
                nonlocal progressed
                progressed = True
                on_progress(done)

            try:
                return self._exchange(endpoint, sock, request, deadline, seen)
            except _Closed:
                if progressed:  # the producer was serving this request: do not repeat it
                    raise
        sock = _connect(endpoint, deadline, self.peer_timeout)
        return self._exchange(endpoint, sock, request, deadline, on_progress)

    def _exchange(
        self,
        endpoint: str,
        sock: socket.socket,
        request: FetchRequest,
        deadline: float,
        on_progress: Callable[[ChunkDone], None],
    ) -> FetchReply:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            _send(sock, encode(request))
            while True:
                reply = decode_message(_recv(sock))
                if not isinstance(reply, ChunkDone):
                    break
                on_progress(reply)
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
        except TimeoutError as e:
            sock.close()
            if e.errno == errno.ETIMEDOUT:  # the kernel gave the producer up (_watch_peer)
                raise PeerGoneError(
                    f"producer {endpoint} acknowledged nothing for {self.peer_timeout} s"
                ) from None
            raise DeadlineExceededError(f"producer {endpoint} did not answer in time") from None
        except ConnectionError as e:  # closed or reset: a reused one may just be stale
            sock.close()
            raise _Closed(f"producer {endpoint} closed the connection: {e}") from None
        except OSError as e:
            sock.close()
            raise PeerGoneError(f"producer {endpoint} is unreachable: {e}") from None
        except BaseException:  # HandleError, or the caller's on_progress gave up
            sock.close()  # the producer learns at once that nobody reads its answer
            raise
        if not isinstance(reply, FetchReply):
            sock.close()
            raise HandleError(f"producer {endpoint} sent {type(reply).__name__}, not a reply")
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if len(idle) < self._IDLE_MAX:
                idle.append(sock)
                sock = None  # type: ignore[assignment]
        if sock is not None:
            sock.close()
        return reply

    def close(self) -> None:
        """Close every idle connection. Idempotent."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()


def _connect(endpoint: str, deadline: float, peer_timeout: float) -> socket.socket:
    host, port = split_address(endpoint, "producer endpoint")
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"deadline passed before contacting producer {endpoint}")
    try:
        sock = socket.create_connection((host, port), timeout=min(left, peer_timeout))
    except TimeoutError as e:
        if e.errno is None and left <= peer_timeout:  # our deadline came first
            raise DeadlineExceededError(f"producer {endpoint} did not accept in time") from None
        raise PeerGoneError(f"producer {endpoint} did not answer for {peer_timeout} s") from None
    except OSError as e:
        raise PeerGoneError(f"producer {endpoint} is unreachable: {e}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _watch_peer(sock, peer_timeout)
    except BaseException:
        sock.close()
        raise
    return sock

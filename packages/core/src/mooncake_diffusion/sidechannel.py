"""The p2p side channel: a consumer asks the producer to write a payload into it.

One request per TCP connection, framed as a 4-byte big-endian length plus a
``schema`` message (msgpack, versioned; never pickle). The server runs one
accept thread and a small pool of handler threads; ``close()`` joins them all.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mooncake_diffusion.errors import DeadlineExceededError, HandleError, PeerGoneError
from mooncake_diffusion.schema import FetchReply, FetchRequest, decode_message, encode
from mooncake_diffusion.settings import split_address

__all__ = ["SideChannelServer", "call"]

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


def _recv(sock: socket.socket) -> bytes:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > _MAX_FRAME:
        raise HandleError(f"side-channel frame of {n} bytes exceeds {_MAX_FRAME}")
    return _recv_exact(sock, n)


class SideChannelServer:
    """Serves ``FetchRequest``s with ``handler`` (called on a pool thread)."""

    def __init__(
        self, host: str, handler: Callable[[FetchRequest], FetchReply], workers: int = 4
    ) -> None:
        self._handler = handler
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.25)
        self.endpoint = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mcd-p2p-serve")
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
            self._pool.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30)
                msg = decode_message(_recv(conn))
                if not isinstance(msg, FetchRequest):
                    reply = FetchReply("failed", "expected a FetchRequest")
                else:
                    reply = self._handler(msg)
            except (OSError, ConnectionError, HandleError) as e:
                reply = FetchReply("failed", f"bad request: {e}")
            with contextlib.suppress(OSError):
                _send(conn, encode(reply))

    def close(self) -> None:
        """Stop accepting, finish in-flight requests, join every thread. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._sock.close()
        self._thread.join()
        self._pool.shutdown(wait=True)


def call(endpoint: str, request: FetchRequest, deadline: float) -> FetchReply:
    """Send ``request`` to ``endpoint`` and wait for the reply until ``deadline``
    (``time.monotonic()``); raises ``PeerGoneError`` or ``DeadlineExceededError``."""
    host, port = split_address(endpoint, "producer endpoint")
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"deadline passed before contacting producer {endpoint}")
    try:
        with socket.create_connection((host, port), timeout=min(left, 5.0)) as sock:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            _send(sock, encode(request))
            reply = decode_message(_recv(sock))
    except TimeoutError:
        raise DeadlineExceededError(f"producer {endpoint} did not answer in time") from None
    except (OSError, ConnectionError) as e:
        raise PeerGoneError(f"producer {endpoint} is unreachable: {e}") from None
    if not isinstance(reply, FetchReply):
        raise HandleError(f"producer {endpoint} sent {type(reply).__name__}, not a FetchReply")
    return reply

"""Connection limits and timeouts of the HTTP front, so that a flood of idle,
dribbling or long-lived connections cannot starve the API or its health routes.

- ``guarded_http(limits)``: uvicorn's httptools protocol with a header timeout (a
  connection that has not sent a whole request head within ``header_timeout_s``,
  first or after a response, is closed: slowloris) and a cap on open connections
  (past ``max_connections`` a new one gets a 503 and is closed). The keep-alive
  timeout is uvicorn's own. Idle connections cost a socket, never a request slot.
- ``RouteLimits``: ASGI middleware that caps what holds a worker thread or a slot:
  open event streams and blocking waits, per client address and in total (429 and
  503 in OpenAI's error shape, with Retry-After), and other requests in flight in
  total (503). ``/healthz``, ``/readyz`` and ``/metrics`` pass uncounted: they are
  answered on the event loop or from their own thread limiter (``OPS_LIMITER``),
  which no other route shares.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import anyio
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mooncake_diffusion.orchestrator.http.bodies import error_body

__all__ = ["HttpLimits", "RouteLimits", "guarded_http", "thread_limiters"]

_STREAM = re.compile(r"^/v1/requests/[^/]+/events$")
_WAIT = frozenset({"/v1/images/generations"})
OPS_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass(frozen=True)
class HttpLimits:
    """The front's connection limits (defaults hold 1,000 idle connections and 50
    event streams from one address while /healthz and /metrics answer at once)."""

    max_connections: int = 4096
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_streams: int = 128
    max_streams_per_client: int = 64
    max_waits: int = 64
    max_waits_per_client: int = 32
    max_in_flight: int = 256


def thread_limiters(limits: HttpLimits) -> dict[str, anyio.CapacityLimiter]:
    """One worker-thread limiter per kind of route, so that streams and waits (which
    hold a thread for minutes) never take the threads of short calls or of /metrics."""
    return {
        "stream": anyio.CapacityLimiter(limits.max_streams),
        "wait": anyio.CapacityLimiter(limits.max_waits),
        "ops": anyio.CapacityLimiter(4),
    }


def guarded_http(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits``' header timeout and connection cap."""

    class GuardedHttp(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                body = error_body(503, "too_many_connections", "too many open connections")
                transport.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and not self.transport.is_closing():
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttp


class RouteLimits:
    """ASGI middleware: the caps of ``HttpLimits`` on streams, waits and requests."""

    def __init__(self, app: Any, limits: HttpLimits) -> None:
        self.app, self.limits = app, limits
        self.in_flight = 0
        self.by_kind: Counter[str] = Counter()
        self.by_client: Counter[tuple[str, str]] = Counter()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        kind = "stream" if _STREAM.match(path) else "wait" if path in _WAIT else None
        client = (scope.get("client") or ("?", 0))[0]
        refused = self._refusal(kind, client)
        if refused is not None:
            await _answer(send, *refused)
            return
        self.in_flight += 1
        if kind:
            self.by_kind[kind] += 1
            self.by_client[kind, client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if kind:
                self.by_kind[kind] -= 1
                self.by_client[kind, client] -= 1
                if not self.by_client[kind, client]:
                    del self.by_client[kind, client]

    def _refusal(self, kind: str | None, client: str) -> tuple[int, str, str] | None:
        lim = self.limits
        if self.in_flight >= lim.max_in_flight:
            return 503, "overloaded", f"{self.in_flight} requests in flight; try again shortly"
        if kind is None:
            return None
        total, per = {
            "stream": (lim.max_streams, lim.max_streams_per_client),
            "wait": (lim.max_waits, lim.max_waits_per_client),
        }[kind]
        what = "open event streams" if kind == "stream" else "waiting generations"
        if self.by_client[kind, client] >= per:
            return 429, "too_many_requests", f"{per} {what} per client at most"
        if self.by_kind[kind] >= total:
            return 503, "overloaded", f"{total} {what} at most; try again shortly"
        return None


async def _answer(send: Any, status: int, code: str, message: str) -> None:
    body = error_body(status, code, message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

"""Call an ASGI app in this process: one HTTP request, no server or socket between."""

from __future__ import annotations

import asyncio
from typing import Any

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


async def post(app: Any, path: str, body: bytes, headers: dict[str, str]) -> Answer:
    """One POST of ``body`` to ``path`` with ``headers`` (names lower case; a
    Content-Length is not added): ``(status, response headers, response body)``. The
    client stays connected until the answer is complete (a disconnect only after it).
    An exception the app raises after its answer is complete (Starlette re-raises a
    fault once its 500 is sent) is swallowed; one raised before it propagates."""
    answered = asyncio.Event()
    sent = False
    start: dict[str, Any] = {}
    out = bytearray()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            start.update(msg)
        elif msg["type"] == "http.response.body":
            out.extend(msg.get("body", b""))
            if not msg.get("more_body"):
                answered.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    try:
        await asyncio.wait_for(app(scope, receive, send), timeout=30)
    except Exception:
        if not answered.is_set():
            raise
    return start["status"], list(start["headers"]), bytes(out)

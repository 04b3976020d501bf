"""The orchestrator's HTTP JSON API for clients, in front of an ``OrchestratorService``.

Routes (JSON in and out; bytes fields such as ``output`` are base64):

    POST /v1/requests                 {"params": {...}, "request_id"?, "slo_class"?,
                                       "cached_embeddings"? (base64), "deadline_s"?}
                                      -> 201 status
    GET  /v1/requests/{id}            -> 200 status
    POST /v1/requests/{id}/cancel     -> 200 status
    GET  /v1/requests/{id}/events     -> 200 one JSON event per line until the request
                                         finishes (``?follow=0``: what happened so far)
    GET  /v1/cluster                  -> 200 pools, queues, running requests
    GET  /metrics                     -> Prometheus text
    GET  /healthz                     -> 200 {"status": "ok"} (no token needed)

Errors are ``{"error": code, "message": text}``: 400 malformed or invalid input,
401 a missing or wrong bearer token, 404 unknown request or route, 405 wrong
method, 409 a duplicate id or a request that already finished, 411/413 a body
without a length or over ``MAX_BODY``, 415 not JSON, 503 the service is not
answering. Bad input never changes state. ``ApiServer`` binds loopback by
default; binding another address requires a token (every route but /healthz
then needs ``Authorization: Bearer <token>``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.service import (
    OrchestratorService,
    RequestRejected,
    ServiceUnavailable,
)

__all__ = ["MAX_BODY", "ApiServer"]

log = logging.getLogger("mooncake_diffusion.orchestrator.http")

MAX_BODY = 256 * 1024
_SUBMIT_KEYS = {"params", "request_id", "slo_class", "cached_embeddings", "deadline_s"}
_CODES = {
    "duplicate_request": HTTPStatus.CONFLICT,
    "already_finished": HTTPStatus.CONFLICT,
    "unknown_request": HTTPStatus.NOT_FOUND,
}


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class _ApiError(Exception):
    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Server(ThreadingHTTPServer):
    """Tracks open connections so ``close`` can end idle keep-alive ones at once."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, *args: Any) -> None:
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        super().__init__(*args)

    def drop_connections(self) -> None:
        with self.lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


class ApiServer:
    """Serve ``service`` over HTTP on ``host:port`` (0 picks a free port) in a thread.

    ``close()`` stops accepting, ends open event streams' waits and joins every
    handler thread. Raises ``OrchestratorError`` for a non-loopback host without a
    token, or a port that cannot be bound."""

    def __init__(
        self,
        service: OrchestratorService,
        host: str = "127.0.0.1",
        port: int = 7421,
        *,
        token: str | None = None,
    ) -> None:
        if not is_loopback(host) and not token:
            raise OrchestratorError(
                f"binding the API to {host} needs a token (--token or MCD_ORCHESTRATOR_TOKEN)"
            )
        handler = type("Handler", (_Handler,), {"service": service, "token": token})
        try:
            self._httpd = _Server((host, port), handler)
        except OSError as e:
            raise OrchestratorError(f"cannot bind the API to {host}:{port}: {e}") from e
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="mcd-http"
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Idempotent. Close the service first (or together) so streams end."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.drop_connections()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    service: OrchestratorService
    token: str | None
    server_version = "mooncake-diffusion-orchestrator"
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # ------------------------------------------------------------------ dispatch
    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        self._consumed = False
        try:
            url = urlsplit(self.path)
            parts = [p for p in url.path.split("/") if p]
            if parts == ["healthz"]:
                return self._only(method, "GET") or self._json(200, {"status": "ok"})
            self._check_token()
            if parts == ["metrics"]:
                self._only(method, "GET")
                return self._text(200, self.service.metrics_text())
            if parts == ["v1", "cluster"]:
                self._only(method, "GET")
                return self._json(200, self.service.cluster())
            if parts == ["v1", "requests"]:
                self._only(method, "POST")
                return self._submit()
            if len(parts) == 3 and parts[:2] == ["v1", "requests"]:
                self._only(method, "GET")
                self._drain_body()
                return self._json(200, self.service.status(parts[2]))
            if len(parts) == 4 and parts[:2] == ["v1", "requests"] and parts[3] == "cancel":
                self._only(method, "POST")
                body = self._body(required=False)
                reason = (body or {}).get("reason", "cancelled by client")
                if not isinstance(reason, str):
                    raise _ApiError(HTTPStatus.BAD_REQUEST, "bad_value", "reason must be text")
                return self._json(200, self.service.cancel(parts[2], reason))
            if len(parts) == 4 and parts[:2] == ["v1", "requests"] and parts[3] == "events":
                self._only(method, "GET")
                follow = parse_qs(url.query).get("follow", ["1"])[0] not in ("0", "false")
                return self._events(parts[2], follow)
            raise _ApiError(HTTPStatus.NOT_FOUND, "not_found", f"no route {url.path}")
        except _ApiError as e:
            self._error(e.status, e.code, e.message)
        except RequestRejected as e:
            self._error(_CODES.get(e.code, HTTPStatus.BAD_REQUEST), e.code, e.reason)
        except ServiceUnavailable as e:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "unavailable", str(e))

    def _error(self, status: int, code: str, message: str) -> None:
        """Answer an error. A body the route never read is read first (or the connection
        closed): left in the stream, it would be parsed as the next request."""
        if not self._consumed:
            self._drain_body()
        self._json(status, {"error": code, "message": message})

    def _only(self, method: str, allowed: str) -> None:
        if method != allowed:
            raise _ApiError(
                HTTPStatus.METHOD_NOT_ALLOWED, "method_not_allowed", f"use {allowed} here"
            )

    def _check_token(self) -> None:
        if not self.token:
            return
        got = self.headers.get("Authorization", "")
        want = f"Bearer {self.token}"
        if not hmac.compare_digest(got.encode(), want.encode()):
            self._drain_body()
            raise _ApiError(HTTPStatus.UNAUTHORIZED, "unauthorized", "missing or wrong token")

    # ------------------------------------------------------------------ bodies
    def _drain_body(self) -> None:
        self._consumed = True
        n = self.headers.get("Content-Length")
        if n and n.isdigit() and int(n) <= MAX_BODY:
            self.rfile.read(int(n))
        elif n:
            self.close_connection = True

    def _body(self, *, required: bool = True) -> dict[str, Any] | None:
        self._consumed = True
        n = self.headers.get("Content-Length")
        if n is None:
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                raise _ApiError(
                    HTTPStatus.LENGTH_REQUIRED, "length_required", "send Content-Length"
                )
            if required:
                raise _ApiError(HTTPStatus.BAD_REQUEST, "bad_json", "a JSON body is required")
            return None
        if not n.isdigit():
            self.close_connection = True
            raise _ApiError(HTTPStatus.BAD_REQUEST, "bad_request", "bad Content-Length")
        if int(n) > MAX_BODY:
            self.close_connection = True
            raise _ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "too_large",
                f"body of {n} bytes; the limit is {MAX_BODY}",
            )
        raw = self.rfile.read(int(n))
        if not raw and not required:
            return None
        ctype = self.headers.get("Content-Type", "application/json").split(";")[0].strip()
        if ctype != "application/json":
            raise _ApiError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "bad_type", "send application/json")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _ApiError(HTTPStatus.BAD_REQUEST, "bad_json", f"not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _ApiError(HTTPStatus.BAD_REQUEST, "bad_json", "the body must be a JSON object")
        return body

    def _submit(self) -> None:
        body = self._body()
        assert body is not None
        bad = _ApiError
        unknown = sorted(set(body) - _SUBMIT_KEYS)
        if unknown:
            raise bad(HTTPStatus.BAD_REQUEST, "bad_value", f"unknown fields {unknown}")
        params = body.get("params", {})
        if not isinstance(params, dict):
            raise bad(HTTPStatus.BAD_REQUEST, "bad_value", "params must be a JSON object")
        rid = body.get("request_id")
        cls = body.get("slo_class")
        for name, v in (("request_id", rid), ("slo_class", cls)):
            if v is not None and not isinstance(v, str):
                raise bad(HTTPStatus.BAD_REQUEST, "bad_value", f"{name} must be a string")
        emb = body.get("cached_embeddings")
        if emb is not None:
            try:
                emb = base64.b64decode(emb, validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise bad(
                    HTTPStatus.BAD_REQUEST, "bad_value", "cached_embeddings must be base64"
                ) from None
        deadline = body.get("deadline_s")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float)
        ):
            raise bad(HTTPStatus.BAD_REQUEST, "bad_value", "deadline_s must be a number")
        rid = self.service.submit(
            params, request_id=rid, slo_class=cls, cached_embeddings=emb, deadline_s=deadline
        )
        self._json(201, self.service.status(rid))

    # ------------------------------------------------------------------ responses
    def _events(self, rid: str, follow: bool) -> None:
        self._drain_body()
        stream = self.service.events(rid, timeout=None if follow else 0)
        first = next(stream, None)  # raises RequestRejected before any header is sent
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            if first is not None:
                self.wfile.write(msgspec.json.encode(first) + b"\n")
                self.wfile.flush()
            for ev in stream:
                self.wfile.write(msgspec.json.encode(ev) + b"\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, msgspec.json.encode(obj), "application/json")

    def _text(self, status: int, text: str) -> None:
        self._send(status, text.encode(), "text/plain; version=0.0.4")

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

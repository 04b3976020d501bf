"""The orchestrator's HTTP JSON API for clients, on FastAPI + uvicorn, in front of an
``OrchestratorService``. OpenAPI: ``/openapi.json``, browsable at ``/docs``.

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
    GET  /dashboard                   -> the live dashboard (``dashboard.html``; its data
                                         calls carry the token from ``#token=...``)
    /v1/images/..., /v1/videos/...    -> OpenAI-compatible generation (``openai_api.py``)

Errors are ``{"error": code, "message": text}``: 400 malformed or invalid input,
401 a missing or wrong bearer token, 404 unknown request or route, 405 wrong
method, 408 a body not sent within ``BODY_TIMEOUT_S`` (a slow client), 409 a
duplicate id or a request that already finished, 411/413 a body without a length
or over ``MAX_BODY``, 415 not JSON, 503 the service is not answering. Bad input
never changes state. ``ApiServer`` binds loopback by default; binding another
address requires a token (every route but /healthz, /docs and /openapi.json then
needs ``Authorization: Bearer <token>``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import socket
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from mooncake_diffusion.orchestrator import openai_api
from mooncake_diffusion.orchestrator.bodies import (
    BODY_TIMEOUT_S,
    MAX_BODY,
    ApiError,
    parse,
    read_json,
    validation_message,
)
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.service import (
    OrchestratorService,
    RequestRejected,
    ServiceUnavailable,
)
from mooncake_diffusion.orchestrator.status import RequestEvent, RequestStatus

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY", "ApiError", "ApiServer", "build_app"]

log = logging.getLogger("mooncake_diffusion.orchestrator.http")

#: Seconds an idle keep-alive connection is kept open.
KEEP_ALIVE_S = 5
#: Connections served at once; more get 503 from uvicorn.
MAX_CONNECTIONS = 1024
_PUBLIC = frozenset({"/healthz", "/docs", "/openapi.json", "/dashboard"})
_CODES = {
    "duplicate_request": 409,
    "already_finished": 409,
    "unknown_request": 404,
}
_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


# --------------------------------------------------------------------------- models
class SubmitRequest(BaseModel):
    """``POST /v1/requests``: a generation request for the orchestrator."""

    model_config = ConfigDict(extra="forbid", strict=True)
    params: dict[str, Any] = Field(default_factory=dict, description="pipeline parameters")
    request_id: str | None = Field(None, description="chosen by the client; unique")
    slo_class: str | None = Field(None, description="e.g. interactive or batch")
    cached_embeddings: str | None = Field(None, description="base64 prompt embeddings")
    deadline_s: float | None = Field(None, description="seconds from submit")


class CancelRequest(BaseModel):
    """``POST /v1/requests/{id}/cancel`` (the body is optional)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    reason: str = "cancelled by client"


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer."""

    error: str
    message: str


def _schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenAPI components for the msgspec structs the routes return (no second copy)."""
    (status, event), comps = msgspec.json.schema_components(
        [RequestStatus, RequestEvent], ref_template="#/components/schemas/{name}"
    )
    return {"status": status, "event": event}, comps


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


def _error(status: int, code: str, message: str) -> Response:
    return _json({"error": code, "message": message}, status)


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


# --------------------------------------------------------------------------- app
def build_app(
    service: OrchestratorService,
    *,
    token: str | None = None,
    outputs: Path | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> FastAPI:
    """The FastAPI app for ``service``. ``outputs``: where OpenAI-style requests' files
    are written and served from (None: those routes answer 503). ``body_timeout_s``:
    how long a client may take to send a body before it gets 408."""
    shapes, comps = _schemas()
    app = FastAPI(
        title="mooncake-diffusion orchestrator",
        version="1",
        description="Disaggregated diffusion serving: requests, cluster state, metrics.",
    )
    app.state.body_timeout_s = body_timeout_s
    errors = {"4XX": {"model": ErrorBody}, "503": {"model": ErrorBody}}

    def content(schema: dict[str, Any], ctype: str = "application/json") -> dict[str, Any]:
        return {"content": {ctype: {"schema": schema}}}

    status_doc = {**errors, "200": {"description": "the request", **content(shapes["status"])}}

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> Response:
        return _error(e.status, e.code, e.message)

    @app.exception_handler(RequestRejected)
    async def _rejected(_: Request, e: RequestRejected) -> Response:
        return _error(_CODES.get(e.code, 400), e.code, e.reason)

    @app.exception_handler(ServiceUnavailable)
    async def _unavailable(_: Request, e: ServiceUnavailable) -> Response:
        return _error(503, "unavailable", str(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> Response:
        return _error(400, "bad_value", validation_message(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        code = _STATUS_CODES.get(e.status_code, "error")
        if e.status_code == 404:
            return _error(404, code, f"no route {request.url.path}")
        if e.status_code == 405:
            allow = e.headers.get("Allow", "") if e.headers else ""
            return _error(405, code, f"use {allow or 'another method'} here")
        return _error(e.status_code, code, str(e.detail))

    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Response:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > MAX_BODY:
            resp = _error(413, "too_large", f"body of {n} bytes; the limit is {MAX_BODY}")
            resp.headers["Connection"] = "close"
            return resp
        if token and request.url.path not in _PUBLIC:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return _error(401, "unauthorized", "missing or wrong token")
        return await call_next(request)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        page = resources.files(__package__).joinpath("dashboard.html").read_bytes()
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], response_class=Response, responses=errors)
    async def metrics() -> Response:
        text = await run_in_threadpool(service.metrics_text)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/cluster", tags=["ops"], responses=errors)
    async def cluster() -> Response:
        return _json(await run_in_threadpool(service.cluster))

    @app.post(
        "/v1/requests",
        tags=["requests"],
        status_code=201,
        openapi_extra=_body_schema(SubmitRequest),
        responses={**errors, "201": {"description": "accepted", **content(shapes["status"])}},
    )
    async def submit(request: Request) -> Response:
        body = parse(SubmitRequest, await read_json(request) or {})
        emb = None
        if body.cached_embeddings is not None:
            try:
                emb = base64.b64decode(body.cached_embeddings, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, "bad_value", "cached_embeddings must be base64") from None

        def run() -> RequestStatus:
            rid = service.submit(
                body.params,
                request_id=body.request_id,
                slo_class=body.slo_class,
                cached_embeddings=emb,
                deadline_s=body.deadline_s,
            )
            return service.status(rid)

        return _json(await run_in_threadpool(run), 201)

    @app.get("/v1/requests/{request_id}", tags=["requests"], responses=status_doc)
    async def status(request_id: str) -> Response:
        return _json(await run_in_threadpool(service.status, request_id))

    @app.post(
        "/v1/requests/{request_id}/cancel",
        tags=["requests"],
        responses=status_doc,
        openapi_extra=_body_schema(CancelRequest),
    )
    async def cancel(request_id: str, request: Request) -> Response:
        body = parse(CancelRequest, await read_json(request, required=False) or {})
        return _json(await run_in_threadpool(service.cancel, request_id, body.reason))

    @app.get(
        "/v1/requests/{request_id}/events",
        tags=["requests"],
        responses={
            **errors,
            "200": {"description": "one event per line", **content(shapes["event"], "x-ndjson")},
        },
    )
    async def events(request_id: str, follow: str = "1") -> Response:
        stream = service.events(request_id, timeout=None if follow not in ("0", "false") else 0)
        # raises RequestRejected (404) before any header is sent
        first = await run_in_threadpool(next, stream, None)

        def lines() -> Iterator[bytes]:
            if first is not None:
                yield msgspec.json.encode(first) + b"\n"
            for ev in stream:
                yield msgspec.json.encode(ev) + b"\n"

        return StreamingResponse(iterate_in_threadpool(lines()), media_type="application/x-ndjson")

    app.include_router(openai_api.router(service, outputs), tags=["openai"])

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(comps)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# --------------------------------------------------------------------------- server
class ApiServer:
    """Serve ``service`` over HTTP on ``host:port`` (0 picks a free port) with uvicorn in a
    thread. ``outputs``: the folder OpenAI-style requests write into and are served from.

    ``close()`` stops accepting and joins the server thread (close the service first so
    open event streams end). Raises ``OrchestratorError`` for a non-loopback host
    without a token, or a port that cannot be bound."""

    def __init__(
        self,
        service: OrchestratorService,
        host: str = "127.0.0.1",
        port: int = 7421,
        *,
        token: str | None = None,
        outputs: str | Path | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        import uvicorn

        if not is_loopback(host) and not token:
            raise OrchestratorError(
                f"binding the API to {host} needs a token (--token or MCD_ORCHESTRATOR_TOKEN)"
            )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(1024)
        except OSError as e:
            self._sock.close()
            raise OrchestratorError(f"cannot bind the API to {host}:{port}: {e}") from e
        self.host, self.port = self._sock.getsockname()[:2]
        self.outputs = Path(outputs) if outputs is not None else None
        self.app = build_app(
            service, token=token, outputs=self.outputs, body_timeout_s=body_timeout_s
        )
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=2,
            limit_concurrency=MAX_CONNECTIONS,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="mcd-http"
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise OrchestratorError(f"the API server on {host}:{port} did not start")
            time.sleep(0.005)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Idempotent. Close the service first (or together) so streams end."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()

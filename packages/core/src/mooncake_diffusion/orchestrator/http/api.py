"""The orchestrator's HTTP JSON API for clients, on FastAPI + uvicorn, in front of an
``OrchestratorService``. OpenAPI: ``/openapi.json``, browsable at ``/docs`` (Swagger
UI's files served by the stack itself, from the ``fastapi-offline`` package).

Routes (JSON in and out; bytes fields such as ``output`` are base64):

    POST   /v1/requests               {"params": {...}, "request_id"?, "slo_class"?,
                                       "cached_embeddings"? (base64), "deadline_s"?}
                                      -> 201 status
    GET    /v1/requests/{id}          -> 200 status
    POST   /v1/requests/{id}/cancel   -> 200 status
    GET    /v1/requests/{id}/events   -> 200 one JSON event per line until the request
                                         finishes (``?follow=0``: what happened so far)
    GET    /v1/cluster                -> 200 pools, queues, running requests
    POST   /v1/workers/{id}/reassign  {"stages": [...], "reason"?} -> 200 {"worker_id",
                                      "state"}: move a worker to other stages (elastic
                                      pools; what a planner does, for operators)
    POST   /v1/workers/{id}/drain     {"reason"?} -> 200 {"worker_id", "state"}: have it
                                      leave (denoise jobs move at a step boundary)
    GET    /metrics                   -> Prometheus text
    GET    /healthz                   -> 200 {"status": "ok"} (no token needed)
    GET    /readyz                    -> 200 when every stage has a live worker, else 503
    GET    /dashboard                 -> the live dashboard (``dashboard.html``; its data
                                         calls carry the token from ``#token=...``)
    /v1/models, /v1/images/..., /v1/videos/...  OpenAI-compatible (``openai.py``)

Errors, on every route and status, are OpenAI's shape ``{"error": {"message",
"type", "param", "code"}}``: 400 malformed or invalid input (a ``params`` key that
names a path, a request id the workers would refuse, a cost over the class's
ceiling), 401 a missing or wrong bearer token, 403 a cross-site Origin, 404 unknown
request, model or route, 405 wrong method, 408 a body not sent within
``BODY_TIMEOUT_S``, 409 a duplicate id or a request that already finished, 411/413 a
body without a length or over ``MAX_BODY``, 415 a body without the route's
Content-Type, 421 a Host the server does not answer to, 429/503 over a connection
limit (``limits.py``), 500 a server fault, 503 the service is not answering. Bad input
never changes state. ``ApiServer`` binds loopback by default; binding another
address requires a token (every route but /healthz, /readyz, /docs and
/openapi.json then needs ``Authorization: Bearer <token>``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.http import openai
from mooncake_diffusion.orchestrator.http.bodies import (
    BODY_TIMEOUT_S,
    MAX_BODY,
    ApiError,
    error_response,
    parse,
    read_json,
    validation_message,
)
from mooncake_diffusion.orchestrator.http.front import FrontConfig, check_params, check_request_id
from mooncake_diffusion.orchestrator.http.limits import (
    HttpLimits,
    RouteLimits,
    guarded_http,
    thread_limiters,
)
from mooncake_diffusion.orchestrator.service.service import (
    OrchestratorService,
    RequestRejected,
    ServiceUnavailable,
)
from mooncake_diffusion.orchestrator.service.status import RequestEvent, RequestStatus

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY", "ApiError", "ApiServer", "build_app"]

log = logging.getLogger("mooncake_diffusion.orchestrator.http")

_PUBLIC = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json", "/dashboard"})
_STAGES = ("encode", "denoise", "decode")
_CODES = {
    "duplicate_request": 409,
    "already_finished": 409,
    "unknown_request": 404,
    "unknown_worker": 404,
    "not_serving": 409,
}
_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}
_SWAGGER = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")


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


class ReassignRequest(BaseModel):
    """``POST /v1/workers/{id}/reassign``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    stages: list[str] = Field(description='every stage it is to hold, e.g. ["decode"]')
    reason: str = "operator"


class DrainRequest(BaseModel):
    """``POST /v1/workers/{id}/drain`` (the body is optional)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reason: str = "operator"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer (OpenAI's shape)."""

    error: ErrorDetail


def _schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenAPI components for the msgspec structs the routes return (no second copy)."""
    (status, event), comps = msgspec.json.schema_components(
        [RequestStatus, RequestEvent], ref_template="#/components/schemas/{name}"
    )
    return {"status": status, "event": event}, comps


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def _docs_page() -> str:
    return """<!doctype html>
<html><head><meta charset="utf-8"><title>mooncake-diffusion orchestrator - API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" href="/docs/assets/favicon.png"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui",
  presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout"});</script>
</body></html>"""


def _error_handlers(app: FastAPI) -> None:
    """Every error the app can raise, answered in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> Response:
        return error_response(e.status, e.code, e.message, e.param)

    @app.exception_handler(RequestRejected)
    async def _rejected(_: Request, e: RequestRejected) -> Response:
        return error_response(_CODES.get(e.code, 400), e.code, e.reason)

    @app.exception_handler(ServiceUnavailable)
    async def _unavailable(_: Request, e: ServiceUnavailable) -> Response:
        return error_response(503, "unavailable", str(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> Response:
        return error_response(400, "bad_value", *validation_message(e))

    @app.exception_handler(ValueError)
    async def _value(_: Request, e: ValueError) -> Response:
        # input the checks above let through (e.g. a number too long to convert)
        return error_response(400, "bad_value", str(e)[:500] or "invalid input")

    @app.exception_handler(Exception)
    async def _fault(request: Request, e: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal_error", f"the server failed: {type(e).__name__}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        code = _STATUS_CODES.get(e.status_code, "error")
        if e.status_code == 404:
            return error_response(404, code, f"no route {request.url.path}")
        if e.status_code == 405:
            allow = e.headers.get("Allow", "") if e.headers else ""
            return error_response(405, code, f"use {allow or 'another method'} here")
        return error_response(e.status_code, code, str(e.detail))


class _Guard:
    """The front door's checks before any route, as plain ASGI (Starlette's
    ``BaseHTTPMiddleware`` costs a task and two streams per request): the Host and
    Origin names (421 / 403), a declared body over ``MAX_BODY`` (413), then the bearer
    token on every path but the public ones (401). Other scopes pass untouched."""

    def __init__(
        self, app: ASGIApp, *, front: FrontConfig, allowed: frozenset[str] | None, token: str | None
    ) -> None:
        self.app, self.front, self.allowed, self.token = app, front, allowed, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refusal(Headers(scope=scope), scope["path"])
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: Headers, path: str) -> Response | None:
        try:
            self.front.check_origin(headers, self.allowed)
        except ApiError as e:
            return error_response(e.status, e.code, e.message, close=True)
        n = headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > MAX_BODY:
            msg = f"body of {n} bytes; the limit is {MAX_BODY}"
            return error_response(413, "too_large", msg, close=True)
        if self.token and path not in _PUBLIC and not path.startswith("/docs/assets/"):
            got = headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
                return error_response(401, "unauthorized", "missing or wrong token")
        return None


class _Express:
    """The hot route, ``POST /v1/requests``, from the guard straight to its function:
    the same function, checks and error handlers as through the router, without
    FastAPI's exception middleware, routing and dependency solving (their CPU per
    submission: ``docs/performance.md``). Sits inside the guard and the route
    limits, so their checks and counts apply as before; every other request passes
    to ``app``. An error's handler is the app's own for the nearest class of the
    error (``Exception``'s logs it and answers 500)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        submit: Callable[[Request], Awaitable[Response]],
        handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]],
    ) -> None:
        self.app, self.submit, self.handlers = app, submit, handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/requests" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await self.submit(request)
        except Exception as e:
            handler = next(self.handlers[c] for c in type(e).__mro__ if c in self.handlers)
            response = await handler(request, e)
        await response(scope, receive, send)


# --------------------------------------------------------------------------- app
def build_app(
    service: OrchestratorService,
    *,
    token: str | None = None,
    outputs: Path | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    front: FrontConfig | None = None,
    limits: HttpLimits | None = None,
    bound_host: str = "127.0.0.1",
    express: bool = True,
) -> FastAPI:
    """The FastAPI app for ``service``. ``outputs``: where OpenAI-style requests' files
    are served from (None: those routes answer 503). ``body_timeout_s``: how long a
    client may take to send a body before it gets 408. ``front``: admission (Host and
    Origin names, cost ceilings, models); ``limits``: streams and waits per client and
    in total; ``bound_host``: the address the API listens on (the default Host names).
    ``express``: submissions skip the router (``_Express``); ``False`` sends them
    through it like every other route (the same answers, more CPU)."""
    front = front or FrontConfig()
    limits = limits or HttpLimits()
    threads = thread_limiters(limits)
    allowed = front.allowed_hosts(bound_host)
    shapes, comps = _schemas()
    app = FastAPI(
        title="mooncake-diffusion orchestrator",
        version="1",
        description="Disaggregated diffusion serving: requests, cluster state, metrics.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.body_timeout_s = body_timeout_s
    errors = {"4XX": {"model": ErrorBody}, "5XX": {"model": ErrorBody}}

    def content(schema: dict[str, Any], ctype: str = "application/json") -> dict[str, Any]:
        return {"content": {ctype: {"schema": schema}}}

    status_doc = {**errors, "200": {"description": "the request", **content(shapes["status"])}}
    _error_handlers(app)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return HTMLResponse(_docs_page())

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        if name not in _SWAGGER:
            raise ApiError(404, "not_found", f"no asset {name}")
        data = resources.files("fastapi_offline").joinpath("static", name).read_bytes()
        media = {"js": "text/javascript", "css": "text/css", "png": "image/png"}
        return Response(data, media_type=media[name.rsplit(".", 1)[1]])

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        page = resources.files(__package__).joinpath("dashboard.html").read_bytes()
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], responses=errors)
    async def readyz() -> Response:
        view = await anyio.to_thread.run_sync(service.cluster, limiter=threads["ops"])
        have = {s for w in view["workers"] if w["state"] == "serving" for s in w["stages"]}
        missing = [s for s in _STAGES if s not in have]
        if missing:
            raise ApiError(503, "not_ready", f"no live worker for {', '.join(missing)}")
        return _json({"status": "ready", "workers": len(view["workers"])})

    @app.get("/metrics", tags=["ops"], response_class=Response, responses=errors)
    async def metrics() -> Response:
        text = await anyio.to_thread.run_sync(service.metrics_text, limiter=threads["ops"])
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/cluster", tags=["ops"], responses=errors)
    async def cluster() -> Response:
        return _json(await run_in_threadpool(service.cluster))

    @app.post(
        "/v1/workers/{worker_id}/reassign",
        tags=["ops"],
        responses=errors,
        openapi_extra=_body_schema(ReassignRequest),
    )
    async def reassign(worker_id: str, request: Request) -> Response:
        body = parse(ReassignRequest, await read_json(request) or {})
        stages = tuple(body.stages)
        state = await run_in_threadpool(service.reassign, worker_id, stages, body.reason)
        return _json({"worker_id": worker_id, "state": state})

    @app.post(
        "/v1/workers/{worker_id}/drain",
        tags=["ops"],
        responses=errors,
        openapi_extra=_body_schema(DrainRequest),
    )
    async def drain(worker_id: str, request: Request) -> Response:
        body = parse(DrainRequest, await read_json(request, required=False) or {})
        state = await run_in_threadpool(service.drain, worker_id, body.reason)
        return _json({"worker_id": worker_id, "state": state})

    @app.post(
        "/v1/requests",
        tags=["requests"],
        status_code=201,
        openapi_extra=_body_schema(SubmitRequest),
        responses={**errors, "201": {"description": "accepted", **content(shapes["status"])}},
    )
    async def submit(request: Request) -> Response:
        body = parse(SubmitRequest, await read_json(request) or {})
        if body.request_id is not None:
            check_request_id(body.request_id)
        check_params(body.params)
        front.check_cost(body.params, body.slo_class)
        emb = None
        if body.cached_embeddings is not None:
            try:
                emb = base64.b64decode(body.cached_embeddings, validate=True)
            except (binascii.Error, ValueError):
                msg = "cached_embeddings must be base64"
                raise ApiError(400, "bad_value", msg, "cached_embeddings") from None

        # one driver call, awaited on this loop: the submit answers its own status
        st = await service.submit_async(
            body.params,
            request_id=body.request_id,
            slo_class=body.slo_class,
            cached_embeddings=emb,
            deadline_s=body.deadline_s,
        )
        return _json(st, 201)

    @app.get("/v1/requests/{request_id}", tags=["requests"], responses=status_doc)
    async def status(request_id: str) -> Response:
        return _json(await service.status_async(request_id))

    @app.post(
        "/v1/requests/{request_id}/cancel",
        tags=["requests"],
        responses=status_doc,
        openapi_extra=_body_schema(CancelRequest),
    )
    async def cancel(request_id: str, request: Request) -> Response:
        body = parse(CancelRequest, await read_json(request, required=False) or {})
        return _json(await service.cancel_async(request_id, body.reason))

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
        # each stream holds a thread of its own limiter (never one of the short calls')
        step = threads["stream"]
        # raises RequestRejected (404) before any header is sent
        first = await anyio.to_thread.run_sync(next, stream, None, limiter=step)

        async def lines() -> Any:
            ev = first
            while ev is not None:
                yield msgspec.json.encode(ev) + b"\n"
                ev = await anyio.to_thread.run_sync(next, stream, None, limiter=step)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    app.include_router(openai.router(service, outputs, front, threads["wait"]), tags=["openai"])

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(comps)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # the last added runs first: the route limits, the guard, then the express route
    if express:
        app.add_middleware(_Express, submit=submit, handlers=app.exception_handlers)
    app.add_middleware(_Guard, front=front, allowed=allowed, token=token)
    app.add_middleware(RouteLimits, limits=limits)
    return app


# --------------------------------------------------------------------------- server
def listen(host: str, port: int, token: str | None) -> socket.socket:
    """The API's listening socket on ``host:port`` (0 picks a free port). Raises
    ``OrchestratorError`` for a non-loopback host without a token, or a port that
    cannot be bound."""
    if not is_loopback(host) and not token:
        raise OrchestratorError(
            f"binding the API to {host} needs a token (--token or MCD_ORCHESTRATOR_TOKEN)"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as e:
        sock.close()
        raise OrchestratorError(f"cannot bind the API to {host}:{port}: {e}") from e
    return sock


class ApiServer:
    """Serve ``service`` over HTTP on ``host:port`` (0 picks a free port) with uvicorn in a
    thread. ``outputs``: the folder the decode workers write into (their ``MCD_OUTPUTS``)
    and OpenAI-style requests' files are served from. ``front`` and ``limits``: see
    ``build_app``; ``sock``: a listening socket to serve (``listen``; the server
    closes it) instead of binding ``host:port``. ``drive``: ``service`` is not
    started yet, and its driver turns on the server's event loop
    (``OrchestratorService.run_on_loop``): one thread for HTTP and the driver, no
    hand-off between them; the service's startup errors are raised here.

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
        front: FrontConfig | None = None,
        limits: HttpLimits | None = None,
        sock: socket.socket | None = None,
        drive: bool = False,
    ) -> None:
        import uvicorn

        self._sock = sock if sock is not None else listen(host, port, token)
        self.host, self.port = self._sock.getsockname()[:2]
        self.outputs = Path(outputs) if outputs is not None else None
        limits = limits or HttpLimits()
        self.app = build_app(
            service,
            token=token,
            outputs=self.outputs,
            body_timeout_s=body_timeout_s,
            front=front,
            limits=limits,
            bound_host=host,
        )
        config = uvicorn.Config(
            self.app,
            http=guarded_http(limits),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=limits.keep_alive_s,
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._failed: BaseException | None = None
        run: Callable[[], None] = partial(self._server.run, sockets=[self._sock])
        if drive:
            run = partial(self._drive, service, config.get_loop_factory())
        self._thread = threading.Thread(target=run, name="mcd-http")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                if self._failed is not None:
                    raise self._failed
                raise OrchestratorError(f"the API server on {host}:{port} did not start")
            time.sleep(0.005)

    def _drive(self, service: OrchestratorService, loop_factory: Any) -> None:
        """The server thread with ``drive``: the service's driver and uvicorn on one
        loop; the driver leaves it when the server stops."""

        async def main() -> None:
            try:
                service.run_on_loop()
            except BaseException as e:
                self._failed = e
                return
            try:
                await self._server.serve(sockets=[self._sock])
            finally:
                service.leave_loop()

        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Idempotent. Close the service first (or together) so streams end."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()

"""Request bodies and error answers for the HTTP routes.

``read_json`` / ``read_form`` enforce the same body limits on every route and
content type (``MAX_BODY``, ``BODY_TIMEOUT_S``, a Content-Length, a declared
Content-Type) and ``parse`` validates a body against a pydantic model; all raise
``ApiError``. ``error_response`` is the one error shape of every route and status,
OpenAI's: ``{"error": {"message", "type", "param", "code"}}``. Used by ``api.py``,
``openai.py`` and ``limits.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

__all__ = [
    "BODY_TIMEOUT_S",
    "MAX_BODY",
    "ApiError",
    "error_body",
    "error_response",
    "parse",
    "read_form",
    "read_json",
    "validation_message",
]

MAX_BODY = 256 * 1024
#: Seconds a client has to send a whole request body (a slow client gets 408).
BODY_TIMEOUT_S = 10.0
_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


class ApiError(Exception):
    """An answer of ``status`` in OpenAI's error shape; ``param`` names the field."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    err = {"message": message, "type": _type(status), "param": param, "code": code}
    return msgspec.json.encode({"error": err})


def error_response(
    status: int, code: str, message: str, param: str | None = None, *, close: bool = False
) -> Response:
    resp = Response(error_body(status, code, message, param), status, media_type="application/json")
    if close:
        resp.headers["Connection"] = "close"
    return resp


def validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """(a message naming each bad field, the first bad field or None)."""
    parts, first = [], None
    for err in e.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        first = first or (where if where != "body" else None)
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid input", first


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read(request: Request, types: tuple[str, ...], *, required: bool) -> bytes | None:
    """The raw body, within the limits. A body needs a Content-Length (411 without)
    and a Content-Type of ``types`` (415 otherwise, a missing one included: a
    browser's cross-site "simple" request can carry no type or a form type)."""
    n = request.headers.get("content-length")
    if n is None:
        if request.headers.get("transfer-encoding"):
            raise ApiError(411, "length_required", "send Content-Length (chunked is refused)")
        if required:
            raise ApiError(400, "missing_body", f"a {types[0]} body is required")
        return None
    if not n.isdigit() or len(n) > 12:
        raise ApiError(400, "bad_request", "bad Content-Length")
    if int(n) > MAX_BODY:
        raise ApiError(413, "too_large", f"body of {n} bytes; the limit is {MAX_BODY}")
    if int(n) == 0 and not required:
        return None
    if content_type(request) not in types:
        got = content_type(request) or "no Content-Type"
        raise ApiError(415, "unsupported_media_type", f"send {' or '.join(types)}, not {got}")
    limit = getattr(request.app.state, "body_timeout_s", BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(limit):
            return await request.body()
    except TimeoutError:
        raise ApiError(408, "timeout", f"body not sent within {limit:g}s") from None


async def read_json(request: Request, *, required: bool = True) -> dict[str, Any] | None:
    """The request's JSON object body, or None when absent and not ``required``.

    Raises ``ApiError``: 411 chunked without a length, 400 a bad length or not a
    JSON object, 413 over ``MAX_BODY``, 415 a missing or other content type, 408
    when the body does not arrive within ``BODY_TIMEOUT_S``."""
    raw = await _read(request, ("application/json",), required=required)
    if raw is None:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, "bad_json", f"not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "the body must be a JSON object")
    return body


async def read_form(request: Request) -> dict[str, str]:
    """A form body's text fields, under the same limits as ``read_json`` (files and
    more than 64 fields are refused: 400)."""
    await _read(request, _FORMS, required=True)
    try:
        form = await request.form(max_files=0, max_fields=64)
    except Exception as e:  # starlette's MultiPartException / HTTPException
        raise ApiError(400, "bad_form", f"not a form: {getattr(e, 'detail', e)}") from None
    try:
        return {k: v for k, v in form.items() if isinstance(v, str)}
    finally:
        await form.close()


def is_form(request: Request) -> bool:
    return content_type(request) in _FORMS


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` validated as ``model``; ``ApiError`` 400 ``bad_value`` naming the fields."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, "bad_value", message, param) from None

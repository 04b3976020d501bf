"""Request bodies for the HTTP routes: limits, JSON parsing and the API's error type.

``read_json`` enforces the body limits (``MAX_BODY``, ``BODY_TIMEOUT_S``, content
type) and ``parse`` validates a body against a pydantic model; both raise
``ApiError``, which the app answers as ``{"error": code, "message": text}``. Used by
``api.py`` and ``openai_api.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY", "ApiError", "parse", "read_json", "validation_message"]

MAX_BODY = 256 * 1024
#: Seconds a client has to send a whole request body (a slow client gets 408).
BODY_TIMEOUT_S = 10.0


class ApiError(Exception):
    """An answer of ``status`` with ``{"error": code, "message": message}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def validation_message(e: ValidationError | RequestValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid input"


async def read_json(request: Request, *, required: bool = True) -> dict[str, Any] | None:
    """The request's JSON object body, or None when absent and not ``required``.

    Raises ``ApiError``: 411 chunked without a length, 400 a bad length or not a
    JSON object, 413 over ``MAX_BODY``, 415 another content type, 408 when the body
    does not arrive within ``BODY_TIMEOUT_S``. A missing Content-Type means JSON."""
    n = request.headers.get("content-length")
    if n is None:
        if request.headers.get("transfer-encoding"):
            raise ApiError(411, "length_required", "send Content-Length")
        if required:
            raise ApiError(400, "bad_json", "a JSON body is required")
        return None
    if not n.isdigit():
        raise ApiError(400, "bad_request", "bad Content-Length")
    if int(n) > MAX_BODY:
        raise ApiError(413, "too_large", f"body of {n} bytes; the limit is {MAX_BODY}")
    try:
        limit = getattr(request.app.state, "body_timeout_s", BODY_TIMEOUT_S)
        raw = await asyncio.wait_for(request.body(), limit)
    except TimeoutError:
        raise ApiError(408, "timeout", f"body not sent within {limit:g}s") from None
    if not raw and not required:
        return None
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if ctype != "application/json":
        raise ApiError(415, "bad_type", "send application/json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "bad_json", f"not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "the body must be a JSON object")
    return body


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` validated as ``model``; ``ApiError`` 400 ``bad_value`` naming the fields."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ApiError(400, "bad_value", validation_message(e)) from None

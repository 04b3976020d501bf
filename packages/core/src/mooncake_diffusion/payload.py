"""What callers hand to publish() and get back from publish() and consume()."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mooncake_diffusion.errors import DeadlineExceededError, PayloadError
from mooncake_diffusion.schema import MAX_META_BYTES, Kind, LeaseMode, PayloadHandle

__all__ = ["Publication", "ReceivedPayload", "StagePayload"]

_KINDS = ("embedding", "latent", "feature", "checkpoint")
_LEASES = ("delete_on_consume", "shared")


@dataclass(frozen=True)
class StagePayload:
    """One stage output: named tensors of one request, plus small JSON-able ``meta``.

    ``tensor=`` is shorthand for ``tensors={"tensor": t}``. ``lease`` is
    ``delete_on_consume`` (one consumer; removed once read) or ``shared``
    (many readers until released). The tensors must stay unchanged until the
    publication is done (store) or consumed (p2p).
    """

    request_id: str
    kind: Kind
    tensors: Mapping[str, Any] = field(default_factory=dict)
    tensor: Any = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    lease: LeaseMode = "delete_on_consume"

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not 0 < len(self.request_id) <= 256:
            raise PayloadError("request_id must be a non-empty string of at most 256 chars")
        if "/" in self.request_id:
            raise PayloadError(f"request_id {self.request_id!r} must not contain '/'")
        if self.kind not in _KINDS:
            raise PayloadError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if self.lease not in _LEASES:
            raise PayloadError(f"lease must be one of {_LEASES}, got {self.lease!r}")
        if self.tensor is not None:
            if self.tensors:
                raise PayloadError("give either tensor= or tensors=, not both")
            object.__setattr__(self, "tensors", {"tensor": self.tensor})
            object.__setattr__(self, "tensor", None)
        if not self.tensors:
            raise PayloadError("a payload needs at least one tensor")
        try:
            meta_json = json.dumps(dict(self.meta), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise PayloadError(f"meta must be JSON-serializable: {e}") from None
        if len(meta_json) > MAX_META_BYTES:
            raise PayloadError(f"meta is {len(meta_json)} bytes encoded; the limit is 8 KiB")
        object.__setattr__(self, "_meta_json", meta_json)

    @property
    def meta_json(self) -> str:
        return self.__dict__["_meta_json"]


class Publication:
    """A publish in flight: ``handle`` is usable at once; the bytes may still move.

    ``wait(timeout)`` blocks until the payload can be consumed and re-raises any
    publish error; ``await publication`` does the same in asyncio. ``release()``
    withdraws the payload wherever it is (idempotent).
    """

    def __init__(
        self, handle: PayloadHandle, future: Future[None], release: Callable[[], None]
    ) -> None:
        self.handle = handle
        self._future = future
        self._release = release

    def wait(self, timeout: float | None = None) -> PayloadHandle:
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"publish of {self.handle.payload_id} not done within {timeout}s"
            ) from None
        return self.handle

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Generator[Any, None, PayloadHandle]:
        yield from asyncio.wrap_future(self._future).__await__()
        return self.handle

    def encode(self) -> bytes:
        """The handle as bytes, for a queue message."""
        return self.handle.encode()

    def release(self) -> None:
        self._release()


class ReceivedPayload:
    """Consumed tensors: views into the caller's ``dst`` or into connector-owned
    registered memory. ``release()`` (or leaving a ``with`` block) returns the
    connector-owned memory; views must not be used after that."""

    def __init__(
        self, handle: PayloadHandle, tensors: dict[str, Any], release: Callable[[], None]
    ) -> None:
        self.handle = handle
        self.tensors = tensors
        self._release: Callable[[], None] | None = release

    @property
    def meta(self) -> dict[str, Any]:
        return self.handle.meta

    @property
    def tensor(self) -> Any:
        """The only tensor of a single-tensor payload."""
        if len(self.tensors) != 1:
            raise PayloadError(f"payload has {len(self.tensors)} tensors: {list(self.tensors)}")
        return next(iter(self.tensors.values()))

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> ReceivedPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

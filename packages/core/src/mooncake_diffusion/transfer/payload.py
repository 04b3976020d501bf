"""What callers hand to publish() and get back from publish() and consume()."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mooncake_diffusion.errors import DeadlineExceededError, PayloadError
from mooncake_diffusion.wire.schema import MAX_META_BYTES, Kind, LeaseMode, PayloadHandle

__all__ = [
    "MAX_REQUEST_ID",
    "ChunkView",
    "Publication",
    "ReceivedPayload",
    "StagePayload",
    "request_id_problem",
]

MAX_REQUEST_ID = 256


def request_id_problem(request_id: object) -> str | None:
    """Why ``request_id`` cannot name a request, or None. The one rule of every
    worker (its keys are ``mcd/<request_id>/...``, its files ``<request_id>.png``)
    and of the API: 1..256 characters, no ``/``, no control characters."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID:
        return f"request_id must be a non-empty string of at most {MAX_REQUEST_ID} chars"
    if "/" in request_id:
        return f"request_id {request_id!r} must not contain '/'"
    if any(ord(c) < 32 or ord(c) == 127 for c in request_id):
        return f"request_id {request_id!r} must not contain control characters"
    return None


_KINDS = ("embedding", "latent", "feature", "checkpoint")
_LEASES = ("delete_on_consume", "shared", "retained")


@dataclass(frozen=True)
class StagePayload:
    """One stage output: named tensors of one request, plus small JSON-able ``meta``.

    ``tensor=`` is shorthand for ``tensors={"tensor": t}``. ``lease`` is
    ``delete_on_consume`` (one consumer; removed once read), ``shared``
    (many readers until released; evictable in the store, like a cache entry) or
    ``retained`` (never evicted, not removed by a read: held until released or
    ``cleanup(request_id)``, so a stage re-run after a worker death can read its
    input again; what ``StageWorker`` pipelines use between stages). The
    tensors must stay unchanged until the publication is done (store) or
    consumed (p2p).

    ``ttl_s`` bounds the payload's life: once it passes, the payload is gone
    whether consumed or not (the store's reaper removes it; a p2p producer
    drops it). ``chunk_dim``/``num_chunks`` cut every tensor into ``num_chunks`` slices
    along ``chunk_dim`` (negative counts from the end) that move, and are
    consumed, one by one: e.g. ``chunk_dim=2`` is T of ``[B, C, T, H, W]``.
    """

    request_id: str
    kind: Kind
    tensors: Mapping[str, Any] = field(default_factory=dict)
    tensor: Any = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    lease: LeaseMode = "delete_on_consume"
    chunk_dim: int | None = None
    num_chunks: int = 1
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        problem = request_id_problem(self.request_id)
        if problem is not None:
            raise PayloadError(problem)
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
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise PayloadError(f"num_chunks must be a positive int, got {self.num_chunks!r}")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise PayloadError(f"ttl_s must be positive, got {self.ttl_s!r}")
        if self.num_chunks > 1 and self.chunk_dim is None:
            raise PayloadError("num_chunks > 1 needs a chunk_dim")
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

    ``wait(timeout)`` blocks until every chunk can be consumed and re-raises any
    publish error; ``await publication`` does the same in asyncio. ``release()``
    withdraws the payload wherever it is (idempotent). ``wait_delivered(timeout)``
    blocks until the payload no longer needs this process: in the store (as
    ``wait``), or for p2p, taken by its consumer. A streaming publication
    (``publish(..., stream=True)``) moves chunk ``i`` only after
    ``chunk_ready(i)``: call it as soon as the producer has written that slice.
    """

    def __init__(
        self,
        handle: PayloadHandle,
        future: Future[None],
        release: Callable[[], None],
        chunk_ready: Callable[[int], None],
        held: Callable[[], bool] | None = None,
    ) -> None:
        self.handle = handle
        self._future = future
        self._release = release
        self._chunk_ready = chunk_ready
        self._held = held

    def chunk_ready(self, index: int) -> None:
        """Chunk ``index`` of a streaming publication is written: start moving it.
        Raises ``PayloadError`` for an index out of range or already marked."""
        self._chunk_ready(index)

    def wait(self, timeout: float | None = None) -> PayloadHandle:
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"publish of {self.handle.payload_id} not done within {timeout}s"
            ) from None
        return self.handle

    def wait_delivered(self, timeout: float) -> PayloadHandle:
        """Block until the payload is safe without this process: committed where it
        outlives the producer (the store), or, when the producer itself holds the
        bytes (p2p), until its consumer has taken them. Raises
        ``DeadlineExceededError`` after ``timeout`` seconds (the payload stays
        published: release it to give up) and any publish error, as ``wait``."""
        deadline = time.monotonic() + timeout
        self.wait(timeout)
        delay = 0.0005
        while self._held is not None and self._held():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"{self.handle.payload_id} not taken by its consumer within {timeout}s"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.02)
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


@dataclass(frozen=True)
class ChunkView:
    """Chunk ``index`` of a received payload: views of the destination, no copies."""

    index: int
    tensors: dict[str, Any]

    @property
    def tensor(self) -> Any:
        if len(self.tensors) != 1:
            raise PayloadError(f"payload has {len(self.tensors)} tensors: {list(self.tensors)}")
        return next(iter(self.tensors.values()))


class ReceivedPayload:
    """A payload being received into views of the caller's ``dst`` or of
    connector-owned registered memory.

    Iterating yields each chunk in order as soon as it has landed, while later
    chunks may still be moving; ``chunk(i)`` waits for one chunk; ``tensors``,
    ``tensor`` and ``wait()`` wait for all of them. Transfer errors surface
    there. ``release()`` (or leaving a ``with`` block) waits for the transfer to
    end and returns connector-owned memory; views must not be used after that.
    """

    def __init__(
        self,
        handle: PayloadHandle,
        tensors: dict[str, Any],
        release: Callable[[], None],
        chunk_view: Callable[[int], dict[str, Any]],
        deadline: float,
    ) -> None:
        self.handle = handle
        self._tensors = tensors
        self._release: Callable[[], None] | None = release
        self._release_lock = threading.Lock()
        self._chunk_view = chunk_view
        self._deadline = deadline
        #: how the bytes came: "p2p/net", "p2p/shm", "store" or "memory" (once done)
        self.path = ""
        self._landed = [threading.Event() for _ in range(handle.num_chunks)]
        self._arrived: set[int] = set()
        self._done = threading.Event()
        self._error: BaseException | None = None

    # called by the connector's fetch ---------------------------------------
    def _chunk_landed(self, index: int) -> None:
        self._arrived.add(index)
        self._landed[index].set()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        for event in self._landed:  # wake every waiter; they check what arrived
            event.set()

    # the caller's side -------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        return self.handle.meta

    @property
    def num_chunks(self) -> int:
        return self.handle.num_chunks

    def _until(self, event: threading.Event, timeout: float | None, what: str) -> None:
        # the transfer enforces the deadline itself; the grace lets its error win
        left = self._deadline - time.monotonic() + 1.0 if timeout is None else timeout
        if not event.wait(max(left, 0.0)):
            raise DeadlineExceededError(f"{what} of {self.handle.payload_id} not in time")

    def chunk(self, index: int, timeout: float | None = None) -> ChunkView:
        """Wait for chunk ``index`` (any order) and return its views."""
        if not 0 <= index < self.num_chunks:
            raise PayloadError(f"chunk {index} out of range 0..{self.num_chunks - 1}")
        self._until(self._landed[index], timeout, f"chunk {index}")
        if index not in self._arrived:
            assert self._error is not None
            raise self._error
        return ChunkView(index, self._chunk_view(index))

    def __iter__(self) -> Iterator[ChunkView]:
        for i in range(self.num_chunks):
            yield self.chunk(i)

    def wait(self, timeout: float | None = None) -> ReceivedPayload:
        """Block until every chunk has landed; re-raises the transfer's error."""
        self._until(self._done, timeout, "payload")
        if self._error is not None:
            raise self._error
        return self

    @property
    def tensors(self) -> dict[str, Any]:
        """Every tensor, whole, once all chunks have landed."""
        self.wait()
        return self._tensors

    @property
    def tensor(self) -> Any:
        """The only tensor of a single-tensor payload (waits for all chunks)."""
        tensors = self.tensors
        if len(tensors) != 1:
            raise PayloadError(f"payload has {len(tensors)} tensors: {list(tensors)}")
        return next(iter(tensors.values()))

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def release(self) -> None:
        """Idempotent and thread-safe: the memory is handed back once, whoever calls."""
        with self._release_lock:
            release, self._release = self._release, None
        if release is not None:
            self._done.wait()  # never hand memory back while bytes may still land in it
            release()

    def __enter__(self) -> ReceivedPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

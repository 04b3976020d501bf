"""The front's side of the bridge (``bridge.py``): ``RemoteService`` has the
methods the HTTP API calls (``api.py``, ``openai.py``) with the service's
signatures and errors, carried to a ``BridgeServer`` in the service's process.

    remote = RemoteService(path, call_timeout_s=10.0)
    st = await remote.submit_async(params, request_id="r1")     # on an event loop
    remote.status("r1"); remote.wait("r1", timeout=60)         # from a thread
    for ev in remote.events("r1"): ...

A call not answered within ``call_timeout_s``, or whose connection breaks,
raises ``ServiceUnavailable`` (as the service's own call does when its driver is
late); the next call connects again. Async calls share one connection per event
loop, sync calls one per thread, and each event stream has its own.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgspec

from mooncake_diffusion.errors import HandleError
from mooncake_diffusion.orchestrator.service.bridge import (
    HEAD,
    MAX_FRAME,
    Call,
    Reply,
    frame,
    raise_fault,
    read_reply,
)
from mooncake_diffusion.orchestrator.service.service import ServiceUnavailable
from mooncake_diffusion.orchestrator.service.status import RequestEvent, RequestStatus

__all__ = ["RemoteService"]

_CALL_TIMEOUT = object()  # ``RemoteService._call``'s default: the call timeout
_reply_dec = msgspec.msgpack.Decoder(Reply)
_status_dec = msgspec.msgpack.Decoder(RequestStatus)
_event_dec = msgspec.msgpack.Decoder(RequestEvent)
_dict_dec = msgspec.msgpack.Decoder(dict[str, Any])
_str_dec = msgspec.msgpack.Decoder(str)


class _Link:
    """One connection on an event loop, its calls matched to replies by id."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.broken = False
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        why: BaseException | None = None
        try:
            while True:
                (n,) = HEAD.unpack(await self.r.readexactly(HEAD.size))
                if n > MAX_FRAME:
                    raise ConnectionError(f"a {n}-byte reply, over the limit")
                reply = _reply_dec.decode(await self.r.readexactly(n))
                fut = self.pending.pop(reply.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as e:
            why = e
        finally:
            self.broken = True
            self.w.close()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailable(f"the orchestrator connection broke: {why}"))
        self.pending.clear()


class RemoteService:
    """The service's client API through a ``BridgeServer`` at ``path`` (module
    docstring). Thread-safe. ``close()`` closes this thread's connection and marks
    the service closed; other connections close with their threads' and loops'
    objects."""

    def __init__(self, path: str, call_timeout_s: float = 10.0) -> None:
        self.path = path
        self.call_timeout_s = call_timeout_s
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._links: dict[asyncio.AbstractEventLoop, asyncio.Task[_Link]] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -------------------------------------------------------------- async (the API's loop)
    async def _link(self) -> _Link:
        loop = asyncio.get_running_loop()
        with self._lock:
            for gone in [lp for lp in self._links if lp.is_closed()]:
                del self._links[gone]  # its connection closed with it
            task = self._links.get(loop)
            if (
                task is not None
                and task.done()
                and (task.cancelled() or task.exception() or task.result().broken)
            ):
                task = None
            if task is None:
                task = self._links[loop] = loop.create_task(self._open_link())
        return await task

    async def _open_link(self) -> _Link:
        try:
            r, w = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        except OSError as e:
            raise ServiceUnavailable(f"the orchestrator is not answering: {e}") from None
        return _Link(r, w)

    async def _call_async(self, op: str, args: dict[str, Any]) -> msgspec.Raw:
        if self._closed:
            raise ServiceUnavailable("the orchestrator client is closed")
        try:
            async with asyncio.timeout(self.call_timeout_s):
                link = await asyncio.shield(self._link())  # a shared connect, not cancelled
                call = Call(next(self._ids), op, args)
                fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
                link.pending[call.id] = fut
                try:
                    if link.broken:  # it broke after the check in _link: no answer will come
                        raise ServiceUnavailable("the orchestrator connection broke")
                    link.w.write(frame(call))
                    reply = await fut
                finally:
                    link.pending.pop(call.id, None)
        except TimeoutError:
            raise ServiceUnavailable(
                f"the orchestrator did not answer within {self.call_timeout_s} s"
            ) from None
        if reply.fault is not None:
            raise_fault(reply.fault)
        return reply.value

    async def submit_async(
        self,
        params: dict[str, Any] | bytes = b"",
        *,
        request_id: str | None = None,
        slo_class: str | None = None,
        cached_embeddings: bytes | None = None,
        deadline_s: float | None = None,
    ) -> RequestStatus:
        """``OrchestratorService.submit_async``."""
        args = _submit_args(params, request_id, slo_class, cached_embeddings, deadline_s)
        return _status_dec.decode(await self._call_async("submit", args))

    async def status_async(self, request_id: str) -> RequestStatus:
        """``OrchestratorService.status_async``."""
        return _status_dec.decode(await self._call_async("status", {"request_id": request_id}))

    async def cancel_async(
        self, request_id: str, reason: str = "cancelled by client"
    ) -> RequestStatus:
        """``OrchestratorService.cancel_async``."""
        args = {"request_id": request_id, "reason": reason}
        return _status_dec.decode(await self._call_async("cancel", args))

    # -------------------------------------------------------------- sync (worker threads)
    def _connect(self, timeout: float | None) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise ServiceUnavailable(f"the orchestrator is not answering: {e}") from None
        return s

    def _call(self, op: str, args: dict[str, Any], timeout: Any = _CALL_TIMEOUT) -> msgspec.Raw:
        """One call on this thread's connection; ``timeout`` (default the call
        timeout; None waits as long as it takes) bounds the answer."""
        if self._closed:
            raise ServiceUnavailable("the orchestrator client is closed")
        limit: float | None = self.call_timeout_s if timeout is _CALL_TIMEOUT else timeout
        s: socket.socket | None = getattr(self._local, "sock", None)
        try:
            if s is None:
                s = self._local.sock = self._connect(limit)
            s.settimeout(limit)
            call = Call(next(self._ids), op, args)
            s.sendall(frame(call))
            reply = read_reply(s)
        except (OSError, ConnectionError, HandleError, msgspec.DecodeError) as e:
            if s is not None:
                s.close()  # a late answer must not meet the next call
            self._local.sock = None
            if isinstance(e, TimeoutError):
                raise ServiceUnavailable(
                    f"the orchestrator did not answer within {limit} s"
                ) from None
            raise ServiceUnavailable(f"the orchestrator connection broke: {e}") from None
        if reply.id != call.id:  # cannot happen: one call at a time per connection
            s.close()
            self._local.sock = None
            raise ServiceUnavailable("the orchestrator answered another call")
        if reply.fault is not None:
            raise_fault(reply.fault)
        return reply.value

    def submit(
        self,
        params: dict[str, Any] | bytes = b"",
        *,
        request_id: str | None = None,
        slo_class: str | None = None,
        cached_embeddings: bytes | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """``OrchestratorService.submit``."""
        args = _submit_args(params, request_id, slo_class, cached_embeddings, deadline_s)
        return _status_dec.decode(self._call("submit", args)).request_id

    def status(self, request_id: str) -> RequestStatus:
        """``OrchestratorService.status``."""
        return _status_dec.decode(self._call("status", {"request_id": request_id}))

    def cancel(self, request_id: str, reason: str = "cancelled by client") -> RequestStatus:
        """``OrchestratorService.cancel``."""
        args = {"request_id": request_id, "reason": reason}
        return _status_dec.decode(self._call("cancel", args))

    def wait(self, request_id: str, timeout: float | None = None) -> RequestStatus:
        """``OrchestratorService.wait`` (the connection waits ``timeout`` plus the call
        timeout; forever with none, as the service's own)."""
        limit = None if timeout is None else timeout + self.call_timeout_s
        args = {"request_id": request_id, "timeout": timeout}
        return _status_dec.decode(self._call("wait", args, limit))

    def events(self, request_id: str, timeout: float | None = None) -> Iterator[RequestEvent]:
        """``OrchestratorService.events``, on a connection of its own."""
        s = self._connect(self.call_timeout_s)
        try:
            call = Call(next(self._ids), "events", {"request_id": request_id, "timeout": timeout})
            s.sendall(frame(call))
            # the history comes at once; then each event may take up to ``timeout``
            first = True
            while True:
                try:
                    reply = read_reply(s)
                except (OSError, ConnectionError, HandleError, msgspec.DecodeError) as e:
                    if first:
                        raise ServiceUnavailable(
                            f"the orchestrator is not answering: {e}"
                        ) from None
                    return  # the service went away: the stream ends, as the service's own
                if first:
                    first = False
                    s.settimeout(None if timeout is None else timeout + self.call_timeout_s)
                if reply.fault is not None:
                    raise_fault(reply.fault)
                if reply.end:
                    return
                yield _event_dec.decode(reply.value)
        finally:
            s.close()

    def reassign(self, worker_id: str, stages: tuple[str, ...], reason: str = "planner") -> str:
        """``OrchestratorService.reassign``."""
        args = {"worker_id": worker_id, "stages": list(stages), "reason": reason}
        return _str_dec.decode(self._call("reassign", args))

    def drain(self, worker_id: str, reason: str = "drain") -> str:
        """``OrchestratorService.drain``."""
        return _str_dec.decode(self._call("drain", {"worker_id": worker_id, "reason": reason}))

    def cluster(self) -> dict[str, Any]:
        """``OrchestratorService.cluster``."""
        return _dict_dec.decode(self._call("cluster", {}))

    def metrics_text(self) -> str:
        """``OrchestratorService.metrics_text``."""
        return _str_dec.decode(self._call("metrics", {}))

    def close(self) -> None:
        """Refuse further calls and close this thread's connection. Idempotent."""
        self._closed = True
        s = getattr(self._local, "sock", None)
        if s is not None:
            s.close()
            self._local.sock = None


def _submit_args(
    params: dict[str, Any] | bytes,
    request_id: str | None,
    slo_class: str | None,
    cached_embeddings: bytes | None,
    deadline_s: float | None,
) -> dict[str, Any]:
    blob = params if isinstance(params, bytes) else msgspec.json.encode(params)
    return {
        "params": blob,
        "request_id": request_id,
        "slo_class": slo_class,
        "cached_embeddings": cached_embeddings,
        "deadline_s": deadline_s,
    }

"""The service's client API over a local socket, so that the HTTP front can run in
a process of its own (``frontproc.py``): one interpreter parses HTTP, the other
runs the driver, and neither waits for the other's lock.

    server = BridgeServer(service).start()      # in the service's process
    remote = RemoteService(server.path)         # in the front's process
    st = await remote.submit_async({"prompt": "a cat"}, request_id="r1")
    remote.status("r1"); list(remote.events("r1")); remote.cluster()
    remote.close(); server.close()

Wire: a Unix stream socket in a directory only this user may enter. Each message
is a 4-byte big-endian length and a msgpack body: a ``Call`` from the front, a
``Reply`` from the service (``BRIDGE_VERSION`` in every call; another version is
answered with a fault). A call gets one ``Reply`` with its ``id``; ``events`` one
per event and then one with ``end``. No pickle: params cross as the JSON bytes the
front encoded, statuses and events as their msgspec structs.

``RemoteService`` has the methods the HTTP API calls (``api.py``,
``openai_api.py``) with the service's signatures and errors: ``RequestRejected``
keeps its code, ``ServiceUnavailable`` stays retryable, any other fault is an
``OrchestratorError``. A call not answered within ``call_timeout_s``, or whose
connection breaks, raises ``ServiceUnavailable``; the next call connects again.
Async calls share one connection per event loop, sync calls one per thread, and
each event stream has its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.service import (
    OrchestratorService,
    RequestRejected,
    ServiceUnavailable,
)
from mooncake_diffusion.orchestrator.status import RequestEvent, RequestStatus

__all__ = ["BRIDGE_VERSION", "BridgeServer", "Call", "Fault", "RemoteService", "Reply"]

log = logging.getLogger("mooncake_diffusion.orchestrator.bridge")

BRIDGE_VERSION = 1
#: the largest message either side reads (a status can carry a generated image)
MAX_FRAME = 512 << 20
_HEAD = struct.Struct(">I")
_NIL = msgspec.Raw(b"\xc0")  # msgpack nil
#: threads that may block on a long call at once (the front's stream and wait caps)
LONG_CALLS = 256
_CALL_TIMEOUT = object()  # ``RemoteService._call``'s default: the call timeout


class Call(msgspec.Struct, frozen=True):
    """Front -> service: run ``op`` with ``args``; answered with ``id``."""

    id: int
    op: str
    args: dict[str, Any] = {}
    v: int = BRIDGE_VERSION


class Fault(msgspec.Struct, frozen=True):
    """Why a call failed: ``kind`` is ``rejected`` (with the core's ``code``),
    ``unavailable`` or ``error``."""

    kind: str
    message: str
    code: str = ""


class Reply(msgspec.Struct, frozen=True):
    """Service -> front: the answer to call ``id`` (``value`` msgpack, or ``fault``);
    ``end`` closes an event stream."""

    id: int
    value: msgspec.Raw = _NIL
    fault: Fault | None = None
    end: bool = False


_enc = msgspec.msgpack.Encoder()
_call_dec = msgspec.msgpack.Decoder(Call)
_reply_dec = msgspec.msgpack.Decoder(Reply)
_status_dec = msgspec.msgpack.Decoder(RequestStatus)
_event_dec = msgspec.msgpack.Decoder(RequestEvent)
_dict_dec = msgspec.msgpack.Decoder(dict[str, Any])
_str_dec = msgspec.msgpack.Decoder(str)


def _frame(msg: Any) -> bytes:
    body = _enc.encode(msg)
    return _HEAD.pack(len(body)) + body


def _fault_of(e: BaseException) -> Fault:
    if isinstance(e, RequestRejected):
        return Fault("rejected", e.reason, e.code)
    if isinstance(e, ServiceUnavailable):
        return Fault("unavailable", str(e))
    return Fault("error", f"{type(e).__name__}: {e}")


def _raise(f: Fault) -> None:
    if f.kind == "rejected":
        raise RequestRejected(f.code, f.message)
    if f.kind == "unavailable":
        raise ServiceUnavailable(f.message)
    raise OrchestratorError(f"the orchestrator failed the call: {f.message}")


# --------------------------------------------------------------------------- server
class BridgeServer:
    """Serve ``service``'s client API on a Unix socket (``path``) from a thread of
    its own with an event loop. Short calls go to the service's async methods or a
    small pool; ``wait`` and ``events``, which block for as long as a request runs,
    to a pool of ``LONG_CALLS`` threads. ``close()`` stops serving, ends open
    streams' connections and removes the socket's directory. Idempotent."""

    def __init__(self, service: OrchestratorService) -> None:
        self._service = service
        self._dir = tempfile.mkdtemp(prefix="mcd-bridge-")  # mode 0700: this user only
        self.path = os.path.join(self._dir, "api.sock")
        self._short = ThreadPoolExecutor(4, thread_name_prefix="mcd-bridge-call")
        self._long = ThreadPoolExecutor(LONG_CALLS, thread_name_prefix="mcd-bridge-wait")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._closed = False

    def start(self) -> BridgeServer:
        """Listen; returns once the socket accepts connections."""
        started: list[BaseException | None] = []
        ready = threading.Event()

        def run() -> None:
            loop = _new_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready, started))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="mcd-bridge", daemon=True)
        self._thread.start()
        ready.wait()
        if started and started[0] is not None:
            self.close()
            raise OrchestratorError(f"cannot listen on {self.path}: {started[0]}")
        return self

    async def _serve(self, ready: threading.Event, started: list[BaseException | None]) -> None:
        self._stop = asyncio.Event()
        conns: set[asyncio.Task] = set()

        async def accepted(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            conns.add(task)
            try:
                await self._connection(r, w)
            finally:
                conns.discard(task)

        try:
            server = await asyncio.start_unix_server(accepted, self.path, limit=1 << 20)
        except OSError as e:
            started.append(e)
            ready.set()
            return
        started.append(None)
        ready.set()
        async with server:
            await self._stop.wait()
            server.close()
            for t in list(conns):
                t.cancel()
            await asyncio.gather(*conns, return_exceptions=True)

    async def _connection(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        calls: set[asyncio.Task] = set()
        try:
            while True:
                (n,) = _HEAD.unpack(await r.readexactly(_HEAD.size))
                if n > MAX_FRAME:
                    log.warning("bridge: a %d-byte call, over the limit; closing", n)
                    return
                try:
                    call = _call_dec.decode(await r.readexactly(n))
                except msgspec.DecodeError as e:
                    log.warning("bridge: a malformed call (%s); closing", e)
                    return
                t = asyncio.create_task(self._answer(call, w))
                calls.add(t)
                t.add_done_callback(calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the front closed it
        finally:
            for t in list(calls):
                t.cancel()
            w.close()

    async def _answer(self, call: Call, w: asyncio.StreamWriter) -> None:
        try:
            if call.v != BRIDGE_VERSION:
                raise OrchestratorError(
                    f"bridge version {call.v}; this service speaks {BRIDGE_VERSION}"
                )
            if call.op == "events":
                await self._stream(call, w)
                return
            reply = Reply(call.id, msgspec.Raw(_enc.encode(await self._run(call.op, call.args))))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, (RequestRejected, ServiceUnavailable)):
                log.exception("bridge: %s failed", call.op)
            reply = Reply(call.id, fault=_fault_of(e))
        if not w.is_closing():
            w.write(_frame(reply))

    async def _run(self, op: str, a: dict[str, Any]) -> Any:
        svc = self._service
        loop = asyncio.get_running_loop()

        def short(fn: Callable[..., Any], *args: Any) -> Any:
            return loop.run_in_executor(self._short, fn, *args)

        if op == "submit":
            return await svc.submit_async(
                a["params"],
                request_id=a.get("request_id"),
                slo_class=a.get("slo_class"),
                cached_embeddings=a.get("cached_embeddings"),
                deadline_s=a.get("deadline_s"),
            )
        if op == "status":
            return await svc.status_async(a["request_id"])
        if op == "cancel":
            return await svc.cancel_async(a["request_id"], a["reason"])
        if op == "cluster":
            return await short(svc.cluster)
        if op == "metrics":
            return await short(svc.metrics_text)
        if op == "reassign":
            return await short(svc.reassign, a["worker_id"], tuple(a["stages"]), a["reason"])
        if op == "drain":
            return await short(svc.drain, a["worker_id"], a["reason"])
        if op == "wait":
            return await loop.run_in_executor(
                self._long, svc.wait, a["request_id"], a.get("timeout")
            )
        raise OrchestratorError(f"no bridge call {op!r}")

    async def _stream(self, call: Call, w: asyncio.StreamWriter) -> None:
        """Each event of ``service.events`` as a reply, then ``end`` (or a fault)."""
        loop = asyncio.get_running_loop()
        gone = threading.Event()

        def put(frame: bytes) -> None:
            if not w.is_closing():
                w.write(frame)

        def pump() -> None:
            for ev in self._service.events(call.args["request_id"], call.args.get("timeout")):
                if gone.is_set():
                    return
                frame = _frame(Reply(call.id, msgspec.Raw(_enc.encode(ev))))
                loop.call_soon_threadsafe(put, frame)

        try:
            await loop.run_in_executor(self._long, pump)
        except asyncio.CancelledError:
            gone.set()
            raise
        put(_frame(Reply(call.id, end=True)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=10)
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it on Linux; asyncio's own works too
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# --------------------------------------------------------------------------- client
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
                (n,) = _HEAD.unpack(await self.r.readexactly(_HEAD.size))
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
            task = self._links.get(loop)
            if task is not None and task.done() and (task.exception() or task.result().broken):
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
                    link.w.write(_frame(call))
                    reply = await fut
                finally:
                    link.pending.pop(call.id, None)
        except TimeoutError:
            raise ServiceUnavailable(
                f"the orchestrator did not answer within {self.call_timeout_s} s"
            ) from None
        if reply.fault is not None:
            _raise(reply.fault)
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
            s.sendall(_frame(call))
            reply = _read_reply(s)
        except (OSError, ConnectionError, msgspec.DecodeError) as e:
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
            _raise(reply.fault)
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
            s.sendall(_frame(call))
            # the history comes at once; then each event may take up to ``timeout``
            first = True
            while True:
                try:
                    reply = _read_reply(s)
                except (OSError, ConnectionError, msgspec.DecodeError) as e:
                    if first:
                        raise ServiceUnavailable(
                            f"the orchestrator is not answering: {e}"
                        ) from None
                    return  # the service went away: the stream ends, as the service's own
                if first:
                    first = False
                    s.settimeout(None if timeout is None else timeout + self.call_timeout_s)
                if reply.fault is not None:
                    _raise(reply.fault)
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


def _read_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the orchestrator closed the connection")
        buf += chunk
    return bytes(buf)


def _read_reply(s: socket.socket) -> Reply:
    (n,) = _HEAD.unpack(_read_exactly(s, _HEAD.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"a {n}-byte reply, over the limit")
    return _reply_dec.decode(_read_exactly(s, n))

"""The service's client API over a local socket, so that the HTTP front can run in
a process of its own (``http/process.py``): one interpreter parses HTTP, the other
runs the driver, and neither waits for the other's lock. This module is the wire
and the service's side; ``remote.RemoteService`` is the front's.

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

Errors cross as a ``Fault`` and are raised again on the front's side with their
type (``raise_fault``): ``RequestRejected`` keeps its code, ``ServiceUnavailable``
stays retryable, any other is an ``OrchestratorError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.service.service import (
    OrchestratorService,
    RequestRejected,
    ServiceUnavailable,
)
from mooncake_diffusion.transfer.sidechannel import recv_frame

__all__ = [
    "BRIDGE_VERSION",
    "HEAD",
    "MAX_FRAME",
    "BridgeServer",
    "Call",
    "Fault",
    "Reply",
    "frame",
    "raise_fault",
    "read_reply",
]

log = logging.getLogger("mooncake_diffusion.orchestrator.bridge")

BRIDGE_VERSION = 1
#: the largest message either side reads (a status can carry a generated image)
MAX_FRAME = 512 << 20
#: a message's length, before its body
HEAD = struct.Struct(">I")
_NIL = msgspec.Raw(b"\xc0")  # msgpack nil
#: threads that may block on a long call at once (the front's stream and wait caps)
LONG_CALLS = 256


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


def frame(msg: Any) -> bytes:
    """``msg`` as one message: its length, then its msgpack."""
    body = _enc.encode(msg)
    return HEAD.pack(len(body)) + body


def _fault_of(e: BaseException) -> Fault:
    if isinstance(e, RequestRejected):
        return Fault("rejected", e.reason, e.code)
    if isinstance(e, ServiceUnavailable):
        return Fault("unavailable", str(e))
    return Fault("error", f"{type(e).__name__}: {e}")


def raise_fault(f: Fault) -> None:
    """Raise what ``f`` says went wrong, with its type (module docstring)."""
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
        listening: Future = Future()

        def run() -> None:
            loop = _new_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(listening))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="mcd-bridge", daemon=True)
        self._thread.start()
        try:
            listening.result()
        except OSError as e:
            self.close()
            raise OrchestratorError(f"cannot listen on {self.path}: {e}") from e
        return self

    async def _serve(self, listening: Future) -> None:
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
            listening.set_exception(e)
            return
        listening.set_result(None)
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
                (n,) = HEAD.unpack(await r.readexactly(HEAD.size))
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
        except Exception as e:  # a cancelled call (the front went away) is not answered
            if not isinstance(e, (RequestRejected, ServiceUnavailable)):
                log.exception("bridge: %s failed", call.op)
            reply = Reply(call.id, fault=_fault_of(e))
        if not w.is_closing():
            w.write(frame(reply))

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

        def put(msg: bytes) -> None:
            if not w.is_closing():
                w.write(msg)

        def pump() -> None:
            for ev in self._service.events(call.args["request_id"], call.args.get("timeout")):
                if gone.is_set():
                    return
                loop.call_soon_threadsafe(put, frame(Reply(call.id, msgspec.Raw(_enc.encode(ev)))))

        try:
            await loop.run_in_executor(self._long, pump)
        except asyncio.CancelledError:
            gone.set()
            raise
        put(frame(Reply(call.id, end=True)))

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


def read_reply(s: socket.socket) -> Reply:
    """One ``Reply`` from a blocking socket. Raises ``ConnectionError`` (closed),
    ``HandleError`` (over ``MAX_FRAME``), ``OSError`` (its timeout) or
    ``msgspec.DecodeError``."""
    return _reply_dec.decode(recv_frame(s, MAX_FRAME))

"""DiffusionConnector: publish a stage's output, consume another stage's output.

Call sequence (every stage worker has one connector; it both publishes and consumes):

    conn = DiffusionConnector(role="denoise", transfer_mode="auto", settings=s)
    conn.register(out_buffer)           # optional, once: buffers reused across requests
    pub = conn.publish(StagePayload(request_id=r, kind="latent", tensor=out_buffer))
    queue.send(pub.encode())            # the handle is usable at once ...
    pub.wait(timeout=30)                # ... and the bytes are consumable after this
    # in the consumer process:
    with conn.consume(handle_bytes, dst=registered_dst) as got:
        vae.decode(got.tensor)          # a view of dst: no copy was made
    conn.cleanup(r)                     # drop whatever request r still holds
    conn.close()

``publish`` never blocks on bytes: each publication commits on a worker
thread of its own, so one slow request never delays another's handoff.
``consume`` blocks until every tensor has landed or its deadline passes.

Transport choice (``transfer_mode``):
    p2p    the consumer pulls straight from the producer's registered memory
           (Transfer Engine); the producer holds the tensors until consumed.
    store  the producer puts into Mooncake Store and is free at once; the
           bytes outlive the producer; any consumer may come later.
    auto   per payload: p2p when ``publish(..., consumer=...)`` names a
           consumer that is known and ready now, store otherwise.
    memory an in-process fake (unit tests only).

Thread-safe. Producer and consumer sides are separate classes; this facade
only picks and wires them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from mooncake_diffusion.errors import (
    AlreadyConsumedError,
    ConfigError,
    DestinationMismatchError,
    DuplicatePublishError,
    PayloadError,
    PayloadGoneError,
)
from mooncake_diffusion.memory.pool import FreeList
from mooncake_diffusion.memory.samehost import SharedPool
from mooncake_diffusion.memory.tensors import (
    Region,
    check_destination,
    describe,
    empty_buffer,
    narrow,
    view_of,
)
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.chunks import chunk_bounds, plan, plan_for
from mooncake_diffusion.transfer.payload import Publication, ReceivedPayload, StagePayload
from mooncake_diffusion.transfer.transports import Transport, load_transport
from mooncake_diffusion.transfer.transports.base import Plan
from mooncake_diffusion.wire.schema import PayloadHandle, check_chunking, decode_handle

__all__ = ["ConnectorStats", "DiffusionConnector", "TransferMode"]

TransferMode = Literal["p2p", "store", "auto", "memory"]
_MODES = ("p2p", "store", "auto", "memory")
_ROLES = ("encode", "denoise", "decode")


@dataclass(frozen=True)
class ConnectorStats:
    """What a connector holds right now; leak checks compare it with a baseline."""

    live_publications: int
    registered_regions: int
    registered_bytes: int
    #: registered for a transfer that has not released them; 0 when idle
    temporary_registrations: int
    pool_bytes_in_use: int
    #: receive-pool memory held back after a p2p fetch was abandoned mid-transfer (its
    #: producer may still write into it: ``late_write_s`` of the transport)
    pool_bytes_quarantined: int
    transports: tuple[str, ...]
    #: of ``registered_regions`` / ``registered_bytes``: idle buffers a transport keeps
    #: registered for reuse (the store transport's gather scratch, bounded by its pool)
    cached_regions: int = 0
    cached_bytes: int = 0
    #: memory outside the pool written by such a fetch (made for it, or the caller's
    #: ``dst``), kept alive as long: not freed, not to be reused
    late_write_kept_bytes: int = 0


class _Transports:
    """Creates each transport on first use and owns them all."""

    def __init__(self, settings: MooncakeSettings) -> None:
        self._settings = settings
        self._made: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Transport:
        with self._lock:
            t = self._made.get(name)
            if t is None:
                t = self._made[name] = load_transport(name)(self._settings)
            return t

    def existing(self) -> list[Transport]:
        with self._lock:
            return list(self._made.values())

    def close(self) -> None:
        for t in self.existing():
            t.close()
        self._made.clear()


@dataclass
class _Live:
    handle: PayloadHandle
    transport: Transport
    future: Future[None]
    regions: list[Region] = field(default_factory=list)
    plan: Plan = ()
    marked: set[int] = field(default_factory=set)  # chunks handed to a commit
    committed: int = 0
    inflight: int = 0  # commits running now
    settled: threading.Event = field(default_factory=threading.Event)  # set when inflight == 0


class _Publisher:
    """The producer side: describes, prepares and commits publications.

    ``_live`` holds publications that still own producer resources: a commit
    in flight, or a p2p payload not yet consumed. A committed store payload
    owns nothing here (the store host has the bytes), so it moves to
    ``_recent``, a bounded ledger used only to reject duplicates.
    """

    _RECENT_MAX = 65536

    def __init__(self, transports: _Transports, mode: str, workers: int) -> None:
        self._transports = transports
        self._mode = mode
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mcd-publish")
        self._live: dict[tuple[str, str], _Live] = {}
        # handle and transport only: the tensors are not kept alive by the ledger
        self._recent: OrderedDict[tuple[str, str], tuple[PayloadHandle, Transport]] = OrderedDict()
        self._lock = threading.Lock()

    def transport_for(self, consumer: str | None) -> Transport:
        if self._mode == "auto":
            return self._transports.get("p2p" if consumer else "store")
        return self._transports.get(self._mode)

    def publish(self, payload: StagePayload, consumer: str | None, stream: bool) -> Publication:
        specs, regions = [], []
        for name, t in payload.tensors.items():
            spec, region = describe(name, t)
            specs.append(spec)
            regions.append(region)
        chunk_dim = payload.chunk_dim
        if chunk_dim is not None and chunk_dim < 0:
            chunk_dim += len(specs[0].shape)
        try:
            check_chunking(specs, chunk_dim, payload.num_chunks)
        except ValueError as e:
            raise PayloadError(str(e)) from None
        chunk_plan = plan(specs, chunk_dim, payload.num_chunks)
        key = (payload.request_id, payload.kind)
        with self._lock:
            self._prune()
            earlier = self._live[key].handle if key in self._live else None
            earlier = earlier or (self._recent[key][0] if key in self._recent else None)
            if earlier is not None:
                raise DuplicatePublishError(
                    f"request {payload.request_id!r} already published a {payload.kind!r} "
                    f"({earlier.payload_id}); release it or cleanup() the request first"
                )
            transport = self.transport_for(consumer)
            expires_at = time.time() + payload.ttl_s if payload.ttl_s else None
            payload_id = f"{payload.request_id}/{payload.kind}/{uuid.uuid4().hex[:16]}"
            if expires_at is not None:  # readable from any store key (see leases.py)
                payload_id += f"@{int(expires_at * 1000)}"
            source = transport.prepare(payload_id, regions, payload.lease, chunk_plan)
            handle = PayloadHandle(
                payload_id=payload_id,
                request_id=payload.request_id,
                kind=payload.kind,
                transport=transport.name,  # type: ignore[arg-type]
                lease=payload.lease,
                tensors=tuple(specs),
                source=source,  # type: ignore[arg-type]
                meta_json=payload.meta_json,
                chunk_dim=chunk_dim,
                num_chunks=payload.num_chunks,
                ttl_s=payload.ttl_s,
                expires_at=expires_at,
            )
            live = _Live(handle, transport, Future(), regions, chunk_plan)
            self._live[key] = live
        if not stream:  # all chunks exist: commit them in order on one task, so the
            # consumer gets chunk 0 first instead of several chunks landing together
            self._submit(live, range(len(chunk_plan)))
        return Publication(
            handle,
            live.future,
            lambda: self.release(live),
            lambda i: self.chunk_ready(live, i),
            held=lambda: _holds(live),
        )

    def chunk_ready(self, live: _Live, index: int) -> None:
        if not 0 <= index < len(live.plan):
            raise PayloadError(f"chunk {index} out of range 0..{len(live.plan) - 1}")
        self._submit(live, [index])

    def _submit(self, live: _Live, chunks: Sequence[int]) -> None:
        """Hand ``chunks`` to one commit task, in order; each chunk at most once."""
        with self._lock:
            again = live.marked.intersection(chunks)
            if again:
                raise PayloadError(f"chunk {min(again)} of {live.handle.payload_id} already marked")
            if live.future.done():
                return  # failed or released: nothing more moves
            live.marked.update(chunks)
            live.inflight += 1
            live.settled.clear()
        self._pool.submit(self._commit, live, *chunks)

    def _prune(self) -> None:
        """Move p2p payloads their consumer has taken to ``_recent``, and withdraw
        expired ones (lock held). Runs on every publish and ``stats()``."""
        now = time.time()
        for key in [k for k, v in self._live.items() if v.handle.expired(now) and _holds(v)]:
            live = self._live.pop(key)
            live.transport.discard(live.handle)  # p2p discard only drops a hold: no I/O
        for key in [k for k, v in self._live.items() if v.future.done() and not _holds(v)]:
            live = self._live.pop(key)
            self._remember(key, live.handle, live.transport)

    def _remember(self, key: tuple[str, str], handle: PayloadHandle, transport: Transport) -> None:
        self._recent[key] = (handle, transport)
        while len(self._recent) > self._RECENT_MAX:
            self._recent.popitem(last=False)

    def _commit(self, live: _Live, *chunks: int) -> None:
        try:
            for chunk in chunks:
                self._commit_chunk(live, chunk)
        finally:
            with self._lock:
                live.inflight -= 1
                if live.inflight == 0:
                    live.settled.set()

    def _commit_chunk(self, live: _Live, chunk: int) -> None:
        handle, key = live.handle, (live.handle.request_id, live.handle.kind)
        if live.future.done():
            return  # withdrawn or failed meanwhile
        try:
            live.transport.commit(
                handle.payload_id, handle.source, live.regions, handle.lease, live.plan, chunk
            )
        except BaseException as e:
            with self._lock:
                first = not live.future.done()
                if first:
                    live.future.set_exception(e)
                if self._live.get(key) is live:
                    del self._live[key]
            if first:
                live.transport.discard(handle)
            return
        with self._lock:
            live.committed += 1
            if live.committed < len(live.plan) or live.future.done():
                return
            live.future.set_result(None)
            if not hasattr(live.transport, "holds") and self._live.get(key) is live:
                del self._live[key]  # the bytes left the producer
                self._remember(key, handle, live.transport)

    def release(self, live: _Live) -> None:
        key = (live.handle.request_id, live.handle.kind)
        with self._lock:
            if self._live.get(key) is live:
                del self._live[key]
            if key in self._recent and self._recent[key][0] is live.handle:
                del self._recent[key]
        self._withdraw(live)

    def _withdraw(self, live: _Live) -> None:
        """Stop further chunks, let running commits finish, then remove every byte."""
        with self._lock:
            if not live.future.done():  # a stream never finished: stop it here
                live.future.set_exception(PayloadError("publication released before all chunks"))
            if live.inflight == 0:
                live.settled.set()
        live.settled.wait()  # a put still writing cannot be removed (Mooncake -703)
        live.transport.discard(live.handle)  # idempotent: fine after a failed commit

    def cleanup(self, request_id: str) -> int:
        with self._lock:
            lives = [self._live.pop(k) for k in [k for k in self._live if k[0] == request_id]]
            recent = [self._recent.pop(k) for k in [k for k in self._recent if k[0] == request_id]]
        for live in lives:
            self._withdraw(live)
        for handle, transport in recent:
            transport.discard(handle)
        return len(lives) + len(recent)

    def live_count(self) -> int:
        with self._lock:
            self._prune()
            return len(self._live)

    def close(self) -> None:
        with self._lock:
            for live in self._live.values():  # streams never completed end here
                if not live.future.done():
                    live.future.set_exception(PayloadError("connector closed mid-stream"))
        self._pool.shutdown(wait=True)
        with self._lock:
            lives, self._live = list(self._live.values()), {}
            self._recent.clear()
        # What is still live owns producer resources: p2p holds (which die with the
        # producer) or streams cut short (whose committed chunks nobody can use).
        # Completed store payloads left _live when they committed: they outlive us.
        for live in lives:
            self._withdraw(live)


def _holds(live: _Live) -> bool:
    """Whether the producer still holds the payload's bytes for a consumer."""
    holds = getattr(live.transport, "holds", None)
    return holds is not None and holds(live.handle.payload_id)


class _Receiver:
    """The consumer side: destinations, the receive pool and the consumed ledger.

    When a fetch fails and its transport says the peer may still write into it
    (``may_write_late``: a p2p fetch broken off before the producer's final
    reply, e.g. its deadline passed or the producer was cut off), the producer's
    bytes may still land until the transport's ``late_write_s`` after the fetch's
    deadline (p2p over TCP: until the producer's kernel gives its connection up,
    about 18 minutes by Linux's defaults; the producer starts no write after the
    deadline). Until then the fetch's receive-pool memory is not handed out
    again (``quarantined``), and the buffers it wrote into outside the pool (made
    for it, or the caller's ``dst``) are kept alive, so that memory is neither
    reused nor freed (``kept``). This starts when the fetch fails, whether or
    not the caller releases the payload. Receive memory the pool cannot give
    meanwhile is allocated per fetch, as for a payload larger than the pool.
    """

    _LEDGER_MAX = 65536

    def __init__(
        self, transports: _Transports, pool_bytes: int, device: str, same_host: bool
    ) -> None:
        self._transports = transports
        self._same_host = same_host and device == "cpu"
        self._shared: SharedPool | None = None
        self._fetchers: ThreadPoolExecutor | None = None  # for chunked (streamed) fetches
        self._pool_bytes = pool_bytes
        self._device = device
        self._pool_buf: Any = None
        self._pool_region: Region | None = None
        self._freelist = FreeList(pool_bytes)
        self._pinned_in: set[str] = set()
        self._consumed: OrderedDict[str, None] = OrderedDict()
        #: (until, pool offsets, buffers outside the pool and their bytes)
        self._quarantine: list[tuple[float, list[int], list[tuple[Any, int]]]] = []
        self._lock = threading.Lock()

    def consume(
        self, handle: Any, dst: Any, timeout: float, committed: bool = False
    ) -> ReceivedPayload:
        h = _as_handle(handle)
        with self._lock:
            if h.payload_id in self._consumed:
                raise AlreadyConsumedError(f"payload {h.payload_id} was already consumed here")
        if h.expired():
            raise PayloadGoneError(f"payload {h.payload_id} expired (ttl {h.ttl_s}s)")
        transport = self._transports.get(h.transport)
        tensors, regions, offsets, outside = self._destinations(h, dst)
        if offsets:
            self._pin_pool(transport)
        deadline = time.monotonic() + timeout

        def settle(error: BaseException | None) -> None:
            self._settle(transport, error, offsets, outside, deadline)

        got = ReceivedPayload(
            h,
            tensors,
            lambda: settle(got._error),
            lambda i: _chunk_views(h, tensors, i),
            deadline,
        )
        if h.num_chunks == 1:  # nothing to overlap: fetch here and raise here
            try:
                self._fetch(transport, h, regions, deadline, got, committed, settle)
            except BaseException as e:
                settle(e)
                raise
            return got
        with self._lock:
            if self._fetchers is None:
                self._fetchers = ThreadPoolExecutor(4, thread_name_prefix="mcd-consume")
            fetchers = self._fetchers
        fetchers.submit(
            self._fetch_quietly, transport, h, regions, deadline, got, committed, settle
        )
        return got

    def _fetch(
        self,
        transport: Transport,
        h: PayloadHandle,
        regions: list[Region],
        deadline: float,
        got: ReceivedPayload,
        committed: bool,
        settle: Callable[[BaseException | None], None],
    ) -> None:
        try:
            got.path = transport.fetch(
                h, regions, plan_for(h), deadline, got._chunk_landed, committed=committed
            )
        except BaseException as e:
            if transport.may_write_late(e):
                settle(e)  # held back now, not only once (or if) the caller releases
            got._finish(e)
            raise
        if h.lease == "delete_on_consume":
            with self._lock:
                self._consumed[h.payload_id] = None
                while len(self._consumed) > self._LEDGER_MAX:
                    self._consumed.popitem(last=False)
        got._finish(None)

    def _fetch_quietly(self, *args: Any) -> None:
        with contextlib.suppress(BaseException):  # the error is handed to the caller
            self._fetch(*args)

    def _destinations(
        self, h: PayloadHandle, dst: Any
    ) -> tuple[dict[str, Any], list[Region], list[int], list[tuple[Any, int]]]:
        """The fetch's tensors by name, their regions, the pool offsets it took, and
        the buffers outside the pool it writes into (the caller's or made here) with
        their bytes."""
        names = [t.name for t in h.tensors]
        if dst is not None and not isinstance(dst, Mapping):
            if len(names) != 1:
                raise DestinationMismatchError(
                    f"payload has tensors {names}; pass dst as a dict keyed by name"
                )
            dst = {names[0]: dst}
        if dst is not None and set(dst) != set(names):
            raise DestinationMismatchError(
                f"dst names {sorted(dst)} do not match the payload's {sorted(names)}"
            )
        tensors: dict[str, Any] = {}
        regions: list[Region] = []
        offsets: list[int] = []
        outside: list[tuple[Any, int]] = []
        self._reclaim()
        try:
            for spec in h.tensors:
                if dst is not None:
                    regions.append(check_destination(spec, dst[spec.name]))
                    tensors[spec.name] = dst[spec.name]
                    outside.append((dst[spec.name], spec.nbytes))
                    continue
                off = self._freelist.allocate(spec.nbytes) if spec.nbytes else None
                if off is None:  # empty tensor, or larger than the pool's free space
                    buf = empty_buffer(spec.nbytes, self._device)
                    view = view_of(buf, 0, spec)
                    outside.append((buf, spec.nbytes))
                else:
                    offsets.append(off)
                    view = view_of(self._pool(), off, spec)
                tensors[spec.name] = view
                regions.append(describe(spec.name, view)[1])
        except BaseException:
            self._free(offsets)
            raise
        return tensors, regions, offsets, outside

    def _pool(self) -> Any:
        with self._lock:
            if self._pool_buf is None:
                if self._same_host:  # producers on this host copy straight into it
                    self._shared = SharedPool(self._pool_bytes)
                    buf = self._shared.tensor
                else:
                    buf = empty_buffer(self._pool_bytes, self._device)
                buf[:] = 0  # fault the pages in once, not on every first read
                self._pool_buf = buf
                self._pool_region = describe("pool", buf)[1]
            return self._pool_buf

    def _pin_pool(self, transport: Transport) -> None:
        self._pool()
        with self._lock:
            if transport.name not in self._pinned_in:
                assert self._pool_region is not None
                transport.pin(self._pool_region)
                self._pinned_in.add(transport.name)
                attach = getattr(transport, "attach_pool", None)
                if attach is not None and self._shared is not None:
                    attach(self._shared)

    def _free(self, offsets: list[int]) -> None:
        for off in offsets:
            self._freelist.free(off)
        offsets.clear()

    def _settle(
        self,
        transport: Transport,
        error: BaseException | None,
        offsets: list[int],
        outside: list[tuple[Any, int]],
        deadline: float,
    ) -> None:
        """Return a fetch's receive memory; or, if the producer may still write into
        it, hold it until ``late_write_s`` after the fetch's deadline (class
        docstring). Once per fetch: a second call finds nothing left to settle."""
        late = error is not None and transport.may_write_late(error)
        if late and (offsets or outside):
            until = max(time.monotonic(), deadline) + transport.late_write_s
            with self._lock:
                self._quarantine.append((until, list(offsets), list(outside)))
            offsets.clear()
        else:
            self._free(offsets)
        outside.clear()

    def _reclaim(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [offs for t, offs, _ in self._quarantine if t <= now]
            self._quarantine = [q for q in self._quarantine if q[0] > now]
        for offs in due:
            self._free(offs)

    @property
    def pool_in_use(self) -> int:
        self._reclaim()
        return self._freelist.used - self.quarantined

    @property
    def quarantined(self) -> int:
        """Receive-pool bytes held back from late writes."""
        with self._lock:
            offsets = [off for _, offs, _ in self._quarantine for off in offs]
        return sum(self._freelist.size_of(off) for off in offsets)

    @property
    def kept(self) -> int:
        """Bytes outside the pool kept alive for late writes."""
        with self._lock:
            return sum(n for _, _, bufs in self._quarantine for _, n in bufs)

    def stop(self) -> None:
        """Wait for streamed fetches still running, then stop their threads."""
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=True)

    def close(self) -> None:
        """Close the shared pool's fd (call once no transport can write into it)."""
        if self._shared is not None:
            self._shared.close()


def _chunk_views(h: PayloadHandle, tensors: dict[str, Any], index: int) -> dict[str, Any]:
    """Views of chunk ``index`` of every tensor (the whole tensors when unchunked)."""
    if h.chunk_dim is None:
        return tensors
    views = {}
    for spec in h.tensors:
        start, stop = chunk_bounds(spec.shape[h.chunk_dim], h.num_chunks)[index]
        views[spec.name] = narrow(tensors[spec.name], h.chunk_dim, start, stop - start)
    return views


def _as_handle(handle: Any) -> PayloadHandle:
    if isinstance(handle, PayloadHandle):
        return handle
    if isinstance(handle, Publication):
        return handle.handle
    if isinstance(handle, bytes | bytearray | memoryview):
        return decode_handle(handle)
    raise PayloadError(
        f"expected a PayloadHandle, Publication or bytes, got {type(handle).__name__}"
    )


class DiffusionConnector:
    """One stage worker's view of the transfer layer (see the module docstring).

    ``role`` is ``encode``, ``denoise`` or ``decode`` (labels metrics and logs).
    ``settings`` default to ``MooncakeSettings.from_env()``. Mooncake clients
    start lazily: a p2p-only connector never contacts the master. Construction
    fails fast with ``ConfigError`` on bad arguments.
    """

    def __init__(
        self,
        role: str,
        transfer_mode: TransferMode = "auto",
        settings: MooncakeSettings | None = None,
        *,
        publish_workers: int = 4,
        receive_pool_bytes: int = 256 << 20,
        receive_device: str = "cpu",
        timeout_s: float = 30.0,
    ) -> None:
        if role not in _ROLES:
            raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
        if transfer_mode not in _MODES:
            raise ConfigError(f"transfer_mode must be one of {_MODES}, got {transfer_mode!r}")
        if publish_workers < 1 or receive_pool_bytes < 0 or timeout_s <= 0:
            raise ConfigError("publish_workers >= 1, receive_pool_bytes >= 0, timeout_s > 0")
        self.role = role
        self.transfer_mode = transfer_mode
        self.settings = settings or MooncakeSettings.from_env()
        self.timeout_s = timeout_s
        self._transports = _Transports(self.settings)
        self._publisher = _Publisher(self._transports, transfer_mode, publish_workers)
        self._receiver = _Receiver(
            self._transports, receive_pool_bytes, receive_device, self.settings.same_host
        )
        self._closed = False

    def publish(
        self, payload: StagePayload, *, consumer: str | None = None, stream: bool = False
    ) -> Publication:
        """Start publishing ``payload``; returns at once (see ``Publication``).

        ``consumer`` names a consumer known and ready now; in ``auto`` mode that
        selects p2p. With ``stream=True`` the tensors may still be being
        computed: chunk ``i`` moves once ``Publication.chunk_ready(i)`` is called.
        Raises ``PayloadError`` for unusable tensors or a bad chunk plan, and
        ``DuplicatePublishError`` if (request_id, kind) is still live here.
        """
        self._check_open()
        return self._publisher.publish(payload, consumer, stream)

    def consume(
        self,
        handle: PayloadHandle | Publication | bytes,
        dst: Any = None,
        *,
        timeout: float | None = None,
        committed: bool = False,
    ) -> ReceivedPayload:
        """Receive a payload in place.

        ``dst`` is a tensor (single-tensor payloads) or a dict of tensors by
        name, written in place and returned as-is; without it, tensors are views
        into connector-owned registered memory, valid until ``release()``.
        An unchunked payload has landed when this returns; a chunked one is
        fetched in the background: iterate the result to get each chunk as it
        lands. Bad input raises here (``HandleError``, ``DestinationMismatchError``,
        ``AlreadyConsumedError`` for a payload this connector consumed); transfer
        errors (``PayloadGoneError``, ``TransferError``, ``DeadlineExceededError``)
        raise here or, for chunked payloads, from the iteration. ``committed``: the
        caller knows the whole payload was committed (e.g. a stage output the
        orchestrator acknowledged): one not found is gone at once
        (``PayloadGoneError``), not waited for until ``timeout``.

        After a p2p fetch broke off before the producer's final reply (e.g.
        ``DeadlineExceededError``, ``PeerGoneError``) the producer may still write
        into its destination until about 18 minutes after the fetch's deadline
        (the transport's ``late_write_s``): a ``dst`` of yours is kept alive that
        long (``stats().late_write_kept_bytes``); do not reuse it, give a fresh one.
        Device tensors received through a pinned host buffer (the ``staged`` path,
        every tensor of the payload) are the exception: the late bytes can land only
        in that buffer, which the transport holds instead, so ``dst`` is yours again.
        """
        self._check_open()
        return self._receiver.consume(handle, dst, timeout or self.timeout_s, committed)

    def register(self, tensor: Any) -> None:
        """Register ``tensor``'s whole allocation once with every transport this
        connector publishes through, so later publishes and consumes into it
        cost no registration. Lasts until ``unregister`` or ``close``."""
        self._check_open()
        region = describe("registered", tensor)[1]
        for t in self._publish_transports():
            t.pin(region)

    def unregister(self, tensor: Any) -> None:
        """Undo ``register``; in-flight transfers keep their own registration."""
        region = describe("registered", tensor)[1]
        for t in self._transports.existing():
            t.unpin(region)

    def _publish_transports(self) -> list[Transport]:
        if self.transfer_mode == "auto":
            return [self._transports.get("p2p"), self._transports.get("store")]
        return [self._transports.get(self.transfer_mode)]

    def drop(self, handle: PayloadHandle) -> None:
        """Remove the payload ``handle`` describes, whoever published it: withdrawn if
        this connector did, and its store objects removed by exact key (no scan of
        the store). A p2p payload another process holds is not reachable from here:
        it goes with its producer (or its TTL there)."""
        self._publisher.cleanup(handle.request_id)
        if handle.transport == "store":
            self._transports.get("store").discard(handle)

    def payload_keys(self, handle: PayloadHandle) -> tuple[str, ...]:
        """The store keys holding ``handle``'s bytes (empty for a p2p payload), for a
        caller that removes them itself in a batch of its own (``Mailbox``'s commit)."""
        if handle.transport != "store":
            return ()
        return tuple(self._transports.get("store").keys_of(handle))

    def cleanup(self, request_id: str) -> int:
        """Withdraw every publication of ``request_id`` made by this connector,
        and in store mode every stored object of the request, whoever published
        it. Returns how many of this connector's publications were dropped."""
        n = self._publisher.cleanup(request_id)
        for t in self._transports.existing():
            remove = getattr(t, "remove_request", None)
            if remove is not None:
                remove(request_id)
        return n

    def stats(self) -> ConnectorStats:
        regs = [t.registered() for t in self._transports.existing()]
        cached = [
            cache() for t in self._transports.existing() if (cache := getattr(t, "cached", None))
        ]
        return ConnectorStats(
            live_publications=self._publisher.live_count(),
            registered_regions=sum(r[0] for r in regs),
            registered_bytes=sum(r[1] for r in regs),
            temporary_registrations=sum(r[2] for r in regs),
            pool_bytes_in_use=self._receiver.pool_in_use,
            pool_bytes_quarantined=self._receiver.quarantined,
            transports=tuple(t.name for t in self._transports.existing()),
            cached_regions=sum(c[0] for c in cached),
            cached_bytes=sum(c[1] for c in cached),
            late_write_kept_bytes=self._receiver.kept,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("connector is closed")

    def close(self) -> None:
        """Finish in-flight publishes, drop p2p holds, unregister all memory and
        stop every thread. Store payloads stay for their consumers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._publisher.close()
        self._receiver.stop()
        self._transports.close()
        self._receiver.close()  # after the transports: nothing writes into its pool now

    def __enter__(self) -> DiffusionConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Relay through Mooncake Store: the producer puts, any consumer gets, later.

Each (tensor, chunk) is one object, ``f"{prefix}/{tensor}.{chunk}"``: the
chunk's byte ranges in order (inner-dim chunks: see the scratch buffers below).
One larger than the handle's ``part_bytes`` (the producer's
``settings.store_part_bytes``) is cut into parts
``f"{prefix}/{tensor}.{chunk}.{part}"`` of at most that many bytes, so no single
read can outlive the lease the master grants it (Mooncake -707). The prefix is
unique per publication (Store's ``put`` never overwrites, so keys are never reused).
Delete-on-consume objects are hard-pinned (never evicted before their consumer
comes) and removed with force right after the read; retained objects are
hard-pinned too but stay after reads until released; shared objects are
soft-pinned and stay until discarded.

An object made of several byte ranges in host memory (an inner-dim chunk) of at
most ``_GATHER_MAX`` bytes is gathered into one registered scratch buffer
(``recycle.RecycledBuffers``, at most ``_SCRATCH_IDLE`` kept idle) before its put
and scattered from one after its get:
Mooncake moves every range as a transfer of its own, and one memcpy of the bytes
costs less than the extra transfers (``docs/performance.md``). The object's bytes
and key are the same either way, so either end may gather or not.

A chunk is ready when all its objects exist (a put is atomic per object).
Pipelined relay: the producer serves its commits on the side channel
(``sidechannel.SideChannelServer``, the one p2p uses; its endpoint rides in the
handle as ``StoreSource.notify``). A consumer sends a ``FetchRequest`` naming
only the payload and gets a ``ChunkDone`` the moment each chunk's put returns,
then a ``FetchReply``; it reads chunk i while the producer puts chunk i+1, woken
by the message rather than by polling. The side channel was chosen because the
producer already knows every commit, it needs no new server process or port
scheme, and a store payload never depends on it: when the producer is gone,
does not know the payload (it forgot it, or it is an older build) or the
connection breaks, the consumer falls back to polling the lowest missing chunk
with bounded backoff (0.5 ms doubling to 20 ms, reset after each arrival)
until its deadline. Either way it reports each chunk as it is read.

In store mode the producer cannot know when a payload was consumed; two
consumers racing on one delete-on-consume payload may both read it before
the first removes it (the orchestrator gives each payload one consumer).
"""

from __future__ import annotations

import contextlib
import ctypes
import select
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import (
    DeadlineExceededError,
    HandleError,
    MooncakeDiffusionError,
    PayloadGoneError,
)
from mooncake_diffusion.memory.device import nic_reaches_gpu
from mooncake_diffusion.memory.recycle import RecycledBuffers
from mooncake_diffusion.memory.tensors import Region, describe
from mooncake_diffusion.platform.deployment import cuda_build
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.chunks import Segment, plan_for
from mooncake_diffusion.transfer.sidechannel import (
    SideChannelServer,
    connect,
    recv_frame,
    send_frame,
)
from mooncake_diffusion.transfer.staging import Stager
from mooncake_diffusion.transfer.transports.base import Plan, Transport
from mooncake_diffusion.wire.schema import (
    ChunkDone,
    FetchReply,
    FetchRequest,
    LeaseMode,
    PayloadHandle,
    StoreSource,
    decode_message,
    encode,
)

__all__ = ["KEY_ROOT", "StoreTransport"]

#: Every key this package writes starts with this, so an operator can find them.
KEY_ROOT = "mcd/"
_POLL_MIN_S = 0.0005  # bounded backoff while a chunk is not there yet
_POLL_MAX_S = 0.02
_PROGRESS_MAX = 4096  # payloads whose commits this producer still answers for
_WAKE_S = 0.25  # a waiting notify handler re-checks for close() this often
#: larger many-range objects move range by range (their ranges are large too)
_GATHER_MAX = 16 << 20
#: idle gather scratch kept registered for reuse (per store client)
_SCRATCH_IDLE = 64 << 20


class _Progress:
    """One publication's committed chunks, as its notify handlers see them."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.done: set[int] = set()
        self.ended = False  # withdrawn, failed or forgotten: no more commits will come
        self.withdrawn = False  # discarded: its bytes are gone too


def _split(segs: list[Segment], limit: int) -> list[list[Segment]]:
    """``segs`` cut into consecutive parts of at most ``limit`` bytes each (0: one part)."""
    if not limit or sum(s.length for s in segs) <= limit:
        return [segs]
    parts: list[list[Segment]] = [[]]
    room = limit
    for seg in segs:
        offset, left = seg.offset, seg.length
        while left:
            if room == 0:
                parts.append([])
                room = limit
            n = min(left, room)
            parts[-1].append(Segment(seg.tensor, offset, n))
            offset, left, room = offset + n, left - n, room - n
    return parts


def _objects(source: StoreSource, plan: Plan, chunk: int) -> list[tuple[str, list[Segment]]]:
    """The objects of one chunk: (key, segments), tensors in order, each tensor's
    bytes in one object or in parts of at most ``source.part_bytes``."""
    by_tensor: dict[int, list[Segment]] = {}
    for seg in plan[chunk]:
        by_tensor.setdefault(seg.tensor, []).append(seg)
    out = []
    for t, segs in by_tensor.items():
        parts = _split(segs, source.part_bytes)
        base = f"{source.prefix}/{t}.{chunk}"
        if len(parts) == 1:
            out.append((base, parts[0]))
        else:
            out.extend((f"{base}.{p}", part) for p, part in enumerate(parts))
    return out


class _Moved:
    """The buffers one put or get of ``objects`` uses: each object's own ranges, or a
    scratch buffer it is gathered into (``gather()`` before a put) and scattered
    from (``scatter()`` after a get). ``release()`` gives the scratch back."""

    def __init__(
        self,
        pool: RecycledBuffers,
        objects: list[tuple[str, list[Segment]]],
        regions: Sequence[Region],
    ) -> None:
        self.keys = [k for k, _ in objects]
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self._regions = regions
        # (object, scratch array, ranges); a scratch buffer is reused once its array goes
        self._scratch: list[tuple[int, np.ndarray, list[Segment]]] = []
        try:
            for i, (_, segs) in enumerate(objects):
                n = sum(s.length for s in segs)
                if len(segs) > 1 and n <= _GATHER_MAX and _host(segs, regions):
                    scratch = pool.take(n)
                    self._scratch.append((i, scratch, segs))
                    self.ptrs.append([scratch.ctypes.data])
                    self.sizes.append([n])
                else:
                    self.ptrs.append([regions[s.tensor].ptr + s.offset for s in segs])
                    self.sizes.append([s.length for s in segs])
        except BaseException:
            self.release()
            raise

    def gather(self) -> None:
        self._copy(None)

    def scatter(self, found: Sequence[bool]) -> None:
        """Copy each object read into scratch (``found[i]``) to its ranges."""
        self._copy(found)

    def _copy(self, found: Sequence[bool] | None) -> None:
        """Ranges into scratch (``found`` None: a gather), or scratch into the ranges
        of the objects found (a scatter)."""
        for i, scratch, segs in self._scratch:
            if found is not None and not found[i]:
                continue
            at = scratch.ctypes.data
            for s in segs:
                mine = self._regions[s.tensor].ptr + s.offset
                src, dst = (mine, at) if found is None else (at, mine)
                ctypes.memmove(dst, src, s.length)
                at += s.length

    def release(self) -> None:
        self._scratch = []  # the last references: each buffer goes back to the pool


def _host(segs: list[Segment], regions: Sequence[Region]) -> bool:
    return all(regions[s.tensor].device == "cpu" for s in segs)


class StoreTransport(Transport):
    name = "store"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self._client = StoreClient(settings)
        regs = self._client.regs
        self._scratch = RecycledBuffers(
            lambda a: regs.pin(describe("scratch", a)[1]),
            lambda a: regs.unpin(describe("scratch", a)[1]),
            idle_bytes=_SCRATCH_IDLE,
        )
        self._stager = Stager(
            cuda_build, lambda: nic_reaches_gpu(settings.protocol), settings.gpu_path
        )
        self._cv = threading.Condition()
        self._progress: OrderedDict[str, _Progress] = OrderedDict()
        self._server: SideChannelServer | None = None
        self._closing = False
        self.told = 0  # chunks this consumer read on a commit notification (not by polling)

    def prepare(
        self, payload_id: str, regions: Sequence[Region], lease: LeaseMode, plan: Plan
    ) -> StoreSource:
        with self._cv:
            if self._closing:
                return StoreSource(KEY_ROOT + payload_id, self.settings.store_part_bytes)
            if self._server is None:  # first store publish: serve commits from now on
                self._server = SideChannelServer(self.settings.local_hostname, self._notify)
            self._progress[payload_id] = _Progress(len(plan))
            while len(self._progress) > _PROGRESS_MAX:
                self._progress.popitem(last=False)[1].ended = True
                self._cv.notify_all()
            endpoint = self._server.endpoint
        return StoreSource(KEY_ROOT + payload_id, self.settings.store_part_bytes, endpoint)

    def _notify(self, req: FetchRequest, progress: Callable[[ChunkDone], None]) -> FetchReply:
        """Side-channel handler: a ``ChunkDone`` per chunk of ``req.payload_id`` in order,
        each as soon as it is committed; ``gone`` when it is unknown or withdrawn."""
        with self._cv:
            state = self._progress.get(req.payload_id)
        if state is None:  # "failed": the consumer polls (the bytes may well be there)
            return FetchReply("failed", f"payload {req.payload_id} is not followed here")
        for i in range(state.chunks):
            with self._cv:
                while i not in state.done and not state.ended and not self._closing:
                    self._cv.wait(_WAKE_S)
                if i not in state.done:
                    if state.withdrawn:
                        return FetchReply("gone", f"payload {req.payload_id} was withdrawn")
                    return FetchReply("failed", "the producer stopped following it")
            progress(ChunkDone(i, "store"))
        return FetchReply("ok")

    def commit(
        self,
        payload_id: str,
        source: object,
        regions: Sequence[Region],
        lease: LeaseMode,
        plan: Plan,
        chunk: int,
    ) -> None:
        assert isinstance(source, StoreSource)
        objects = _objects(source, plan, chunk)
        used = sorted({s.tensor for _, segs in objects for s in segs})
        staged = self._stager.outbound(regions)  # device tensors: staged per commit
        if staged is not None:
            staged.send(plan[chunk])
            regions = staged.regions
        leases = []
        moved: _Moved | None = None
        try:
            for t in used:
                leases.append(self._client.regs.acquire(regions[t]))
            moved = _Moved(self._scratch, objects, regions)
            moved.gather()
            self._client.put_many(
                moved.keys, moved.ptrs, moved.sizes, pin="soft" if lease == "shared" else "hard"
            )
        finally:
            if moved is not None:
                moved.release()
            for lease_id in leases:
                self._client.regs.release(lease_id)
            if staged is not None:
                staged.release()
        with self._cv:
            state = self._progress.get(payload_id)
            if state is not None:
                state.done.add(chunk)
                self._cv.notify_all()

    def _all_keys(self, handle: PayloadHandle, plan: Plan) -> list[str]:
        assert isinstance(handle.source, StoreSource)
        return [k for c in range(len(plan)) for k, _ in _objects(handle.source, plan, c)]

    def keys_of(self, handle: PayloadHandle) -> list[str]:
        """Every store key of ``handle``'s payload (its parts, chunk by chunk)."""
        return self._all_keys(handle, plan_for(handle))

    def discard(self, handle: PayloadHandle) -> None:
        with self._cv:
            state = self._progress.pop(handle.payload_id, None)
            if state is not None:
                state.ended = state.withdrawn = True
                self._cv.notify_all()
        self._client.remove_many(self._all_keys(handle, plan_for(handle)))

    def fetch(
        self,
        handle: PayloadHandle,
        regions: Sequence[Region],
        plan: Plan,
        deadline: float,
        on_chunk: Callable[[int], None],
        *,
        committed: bool = False,
    ) -> str:
        """Poll the lowest missing chunk (producers commit in order), report each as
        soon as it is read, and reset the backoff whenever one arrives. ``committed``:
        nothing is still being published, so a missing object is gone (no polling)."""
        assert isinstance(handle.source, StoreSource)
        objects = [_objects(handle.source, plan, c) for c in range(len(plan))]
        staged = self._stager.inbound(regions)
        if staged is not None:
            regions = staged.regions
        leases = [self._client.regs.acquire(r) for r in regions if r.nbytes]
        read = 0  # chunks read and reported so far

        def land(chunk: int, wait: bool = True, stop: int = 0) -> bool:
            """Read chunks ``chunk`` .. ``stop - 1`` (just ``chunk`` by default) in one
            batch, then report each in order."""
            nonlocal read
            chunks = range(chunk, max(stop, chunk + 1))
            if not self._read_chunks(
                handle, objects, regions, chunks, len(plan), deadline, wait, committed
            ):
                return False
            for c in chunks:
                if staged is not None:
                    staged.receive(plan[c])
                on_chunk(c)
            read = chunks.stop
            return True

        def told(done: list[ChunkDone]) -> None:
            # The producer tells chunks in order, each once: ``done`` is a run of them,
            # all told while the previous read ran, so one batched read takes them all.
            fresh = [d.index for d in done if d.index >= read]
            if fresh and fresh[0] == read:
                land(read, stop=fresh[-1] + 1)
                self.told += len(fresh)

        try:
            # What is already there costs one read per chunk and no notifier round trip
            # (a payload published whole before its handle was sent: all of it).
            while read < len(plan) and land(read, wait=False):
                pass
            notify = read < len(plan) and bool(handle.source.notify)
            if notify and self._follow(handle, deadline, told) == "gone":
                raise PayloadGoneError(
                    f"payload {handle.payload_id} was withdrawn by its producer after "
                    f"{read} of {len(plan)} chunks"
                )
            for chunk in range(read, len(plan)):  # no notifier, or it stopped: poll
                land(chunk)
        finally:
            for lease_id in leases:
                self._client.regs.release(lease_id)
            if staged is not None:
                staged.release()
        if handle.lease == "delete_on_consume":
            self._client.remove_many([k for objs in objects for k, _ in objs])
        if staged is not None and staged.path:
            return f"store|dst={staged.path}"
        return "store"

    def _read_chunks(
        self,
        handle: PayloadHandle,
        objects: list[list[tuple[str, list[Segment]]]],
        regions: Sequence[Region],
        chunks: range,
        total: int,
        deadline: float,
        wait: bool,
        committed: bool = False,
    ) -> bool:
        """Read ``chunks`` (one batch); with ``wait``, poll with bounded backoff until
        all their objects exist (or raise at the deadline), else report whether one
        attempt got them all. ``committed``: nothing is still being published, so a
        missing object is gone and raises :class:`PayloadGoneError` at once, with or
        without ``wait``."""
        pending = [o for c in chunks for o in objects[c]]
        delay = _POLL_MIN_S
        while pending:
            moved = _Moved(self._scratch, pending, regions)
            try:
                found = self._client.get_many(
                    moved.keys, moved.ptrs, moved.sizes, deadline=deadline
                )
                moved.scatter(found)
            finally:
                moved.release()
            pending = [o for o, ok in zip(pending, found, strict=True) if not ok]
            if not pending:
                return True
            if committed:
                raise PayloadGoneError(
                    f"payload {handle.payload_id} is gone from the store: it was "
                    f"committed, and {len(pending)} of its objects are not there "
                    "(consumed, removed, or lost with a store host or the master)"
                )
            if not wait:
                return False
            if time.monotonic() + delay > deadline:
                self._give_up(handle, total - chunks.start, total)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return True

    def _follow(
        self,
        handle: PayloadHandle,
        deadline: float,
        on_done: Callable[[list[ChunkDone]], None],
    ) -> str:
        """Ask the producer's side channel for ``handle``'s commits and run ``on_done``
        with the ``ChunkDone``s that came (all that are queued when it is free: it reads
        those chunks meanwhile the producer puts the next). Returns the producer's final
        status: ``ok`` (all told), ``gone`` (it withdrew the payload) or, when it
        cannot help (gone process, payload not followed there, broken connection,
        deadline, silent for ``peer_timeout_s``), ``failed``: the caller polls for what
        is left. Errors raised by ``on_done`` propagate; the connection is closed
        either way."""
        assert isinstance(handle.source, StoreSource)
        try:
            sock = connect(handle.source.notify, deadline, self.settings.peer_timeout_s)
        except (OSError, MooncakeDiffusionError):  # unreachable, or the deadline passed
            return "failed"
        with contextlib.closing(sock):
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                send_frame(sock, encode(FetchRequest(handle.payload_id, "", (), ())))
            except OSError:
                return "failed"
            while True:
                batch: list[ChunkDone] = []
                status = None
                try:  # OSError covers timeouts and resets
                    while status is None:
                        if batch and not select.select([sock], [], [], 0)[0]:
                            break  # nothing more told yet: read what was
                        sock.settimeout(max(deadline - time.monotonic(), 0.001))
                        msg = decode_message(recv_frame(sock))
                        if isinstance(msg, ChunkDone):
                            batch.append(msg)
                        else:
                            status = msg.status if isinstance(msg, FetchReply) else "failed"
                except (OSError, HandleError):
                    status = "failed"
                if batch:
                    on_done(batch)  # its errors are the fetch's
                if status is not None:
                    return status

    @staticmethod
    def _give_up(handle: PayloadHandle, missing: int, total: int) -> None:
        if missing < total:  # some chunks landed: the producer is mid-publish
            raise DeadlineExceededError(
                f"payload {handle.payload_id}: {missing} of {total} chunks still missing at "
                "the deadline"
            )
        raise PayloadGoneError(
            f"payload {handle.payload_id} is not in the store: not yet published by the "
            "deadline, already consumed, or removed"
        )

    def pin(self, region: Region) -> None:
        self._client.regs.pin(region)

    def unpin(self, region: Region) -> None:
        self._client.regs.unpin(region)

    def registered(self) -> tuple[int, int, int]:
        regs = self._client.regs
        return regs.count, regs.nbytes, regs.temporary

    def cached(self) -> tuple[int, int]:
        """Idle scratch buffers kept registered for reuse: (count, bytes)."""
        return self._scratch.idle_count, self._scratch.idle

    def remove_request(self, request_id: str) -> int:
        """Remove every object of ``request_id`` in the store, whoever published it."""
        return self._client.remove_prefix(f"{KEY_ROOT}{request_id}/")

    def close(self) -> None:
        with self._cv:
            self._closing = True
            server, self._server = self._server, None
            self._cv.notify_all()
        if server is not None:
            server.close()
        self._scratch.close()
        self._client.close()

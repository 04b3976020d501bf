"""Relay through Mooncake Store: the producer puts, any consumer gets, later.

Each (tensor, chunk) is one object, ``f"{prefix}/{tensor}.{chunk}"``, gathered
from (and scattered into) the chunk's byte ranges with the multi-buffer batch
calls, so an inner-dim chunk needs no staging copy. One larger than the
handle's ``part_bytes`` (the producer's ``settings.store_part_bytes``) is cut
into parts ``f"{prefix}/{tensor}.{chunk}.{part}"`` of at most that many bytes,
so no single read can outlive the lease the master grants it (Mooncake -707).
The prefix is unique per publication (Store's ``put`` never overwrites, so keys are never reused).
Delete-on-consume objects are hard-pinned (never evicted before their consumer
comes) and removed with force right after the read; retained objects are
hard-pinned too but stay after reads until released; shared objects are
soft-pinned and stay until discarded.

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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.chunks import Segment, plan_for
from mooncake_diffusion.deployment import cuda_build
from mooncake_diffusion.device import nic_reaches_gpu
from mooncake_diffusion.errors import (
    DeadlineExceededError,
    HandleError,
    MooncakeDiffusionError,
    PayloadGoneError,
)
from mooncake_diffusion.schema import (
    ChunkDone,
    FetchReply,
    FetchRequest,
    LeaseMode,
    PayloadHandle,
    StoreSource,
    decode_message,
    encode,
)
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.sidechannel import SideChannelServer, connect, recv_frame, send_frame
from mooncake_diffusion.staging import Stager
from mooncake_diffusion.tensors import Region
from mooncake_diffusion.transports.base import Plan, Transport

__all__ = ["KEY_ROOT", "StoreTransport"]

#: Every key this package writes starts with this, so an operator can find them.
KEY_ROOT = "mcd/"
_POLL_MIN_S = 0.0005  # bounded backoff while a chunk is not there yet
_POLL_MAX_S = 0.02
_PROGRESS_MAX = 4096  # payloads whose commits this producer still answers for
_WAKE_S = 0.25  # a waiting notify handler re-checks for close() this often


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


def _buffers(
    objects: list[tuple[str, list[Segment]]], regions: Sequence[Region]
) -> tuple[list[str], list[list[int]], list[list[int]]]:
    keys = [k for k, _ in objects]
    ptrs = [[regions[s.tensor].ptr + s.offset for s in segs] for _, segs in objects]
    sizes = [[s.length for s in segs] for _, segs in objects]
    return keys, ptrs, sizes


class StoreTransport(Transport):
    name = "store"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self._client = StoreClient(settings)
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
        try:
            for t in used:
                leases.append(self._client.regs.acquire(regions[t]))
            self._client.put_many(
                *_buffers(objects, regions),
                pin="soft" if lease == "shared" else "hard",
            )
        finally:
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

        def land(chunk: int, wait: bool = True) -> bool:
            nonlocal read
            if not self._read_chunk(
                handle, objects, regions, chunk, len(plan), deadline, wait, committed
            ):
                return False
            if staged is not None:
                staged.receive(plan[chunk])
            on_chunk(chunk)
            read = chunk + 1
            return True

        def told(done: ChunkDone) -> None:
            if done.index == read:  # the producer tells chunks in order, each once
                land(done.index)
                self.told += 1

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

    def _read_chunk(
        self,
        handle: PayloadHandle,
        objects: list[list[tuple[str, list[Segment]]]],
        regions: Sequence[Region],
        chunk: int,
        total: int,
        deadline: float,
        wait: bool,
        committed: bool = False,
    ) -> bool:
        """Read ``chunk``; with ``wait``, poll with bounded backoff until all its objects
        exist (or raise at the deadline), else report whether one attempt got it all.
        ``committed``: nothing is still being published, so a missing object is gone and
        raises :class:`PayloadGoneError` at once, with or without ``wait``."""
        pending = list(objects[chunk])
        delay = _POLL_MIN_S
        while pending:
            found = self._client.get_many(*_buffers(pending, regions), deadline=deadline)
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
                self._give_up(handle, total - chunk, total)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return True

    @staticmethod
    def _follow(
        handle: PayloadHandle, deadline: float, on_done: Callable[[ChunkDone], None]
    ) -> str:
        """Ask the producer's side channel for ``handle``'s commits and run ``on_done``
        for each ``ChunkDone`` as it comes (it reads the chunk meanwhile the producer
        puts the next). Returns the producer's final status: ``ok`` (all told), ``gone``
        (it withdrew the payload) or, when it cannot help (gone process, payload not
        followed there, broken connection, deadline), ``failed``: the caller polls
        for what is left. Errors raised by ``on_done`` propagate; the connection is
        closed either way."""
        assert isinstance(handle.source, StoreSource)
        try:
            sock = connect(handle.source.notify, deadline)
        except (OSError, MooncakeDiffusionError):  # unreachable, or the deadline passed
            return "failed"
        with contextlib.closing(sock):
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                send_frame(sock, encode(FetchRequest(handle.payload_id, "", (), ())))
            except OSError:
                return "failed"
            while True:
                try:  # OSError covers timeouts and resets
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    msg = decode_message(recv_frame(sock))
                except (OSError, HandleError):
                    return "failed"
                if isinstance(msg, FetchReply):
                    return msg.status
                if not isinstance(msg, ChunkDone):
                    return "failed"
                on_done(msg)  # its errors are the fetch's

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
        self._client.close()

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
Producers commit a publication's chunks in order, so a consumer polls the
lowest missing chunk with bounded backoff (0.5 ms doubling to 20 ms, reset
after each arrival) until its deadline, and reports each chunk as it is read.

In store mode the producer cannot know when a payload was consumed; two
consumers racing on one delete-on-consume payload may both read it before
the first removes it (the orchestrator gives each payload one consumer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.chunks import Segment, plan_for
from mooncake_diffusion.deployment import cuda_build
from mooncake_diffusion.device import nic_reaches_gpu
from mooncake_diffusion.errors import DeadlineExceededError, PayloadGoneError
from mooncake_diffusion.schema import LeaseMode, PayloadHandle, StoreSource
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.staging import Stager
from mooncake_diffusion.tensors import Region
from mooncake_diffusion.transports.base import Plan, Transport

__all__ = ["KEY_ROOT", "StoreTransport"]

#: Every key this package writes starts with this, so an operator can find them.
KEY_ROOT = "mcd/"
_POLL_MIN_S = 0.0005  # bounded backoff while a chunk is not there yet
_POLL_MAX_S = 0.02


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

    def prepare(
        self, payload_id: str, regions: Sequence[Region], lease: LeaseMode, plan: Plan
    ) -> StoreSource:
        return StoreSource(KEY_ROOT + payload_id, self.settings.store_part_bytes)

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

    def _all_keys(self, handle: PayloadHandle, plan: Plan) -> list[str]:
        assert isinstance(handle.source, StoreSource)
        return [k for c in range(len(plan)) for k, _ in _objects(handle.source, plan, c)]

    def discard(self, handle: PayloadHandle) -> None:
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
        try:
            delay = _POLL_MIN_S
            for chunk, objs in enumerate(objects):
                pending = list(objs)
                while pending:
                    found = self._client.get_many(*_buffers(pending, regions), deadline=deadline)
                    pending = [o for o, ok in zip(pending, found, strict=True) if not ok]
                    if not pending:
                        break
                    if committed:
                        raise PayloadGoneError(
                            f"payload {handle.payload_id} is gone from the store: it was "
                            f"committed, and {len(pending)} of its objects are not there "
                            "(consumed, removed, or lost with a store host or the master)"
                        )
                    if time.monotonic() + delay > deadline:
                        self._give_up(handle, len(plan) - chunk, len(plan))
                    time.sleep(delay)
                    delay = min(delay * 2, _POLL_MAX_S)
                delay = _POLL_MIN_S  # progress: the next chunk is probably close behind
                if staged is not None:
                    staged.receive(plan[chunk])
                on_chunk(chunk)
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
        self._client.close()

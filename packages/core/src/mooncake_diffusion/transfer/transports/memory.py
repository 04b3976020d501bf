"""An in-process fake transport that obeys the transport contract exactly.

Bytes are copied into a process-wide "fabric" at commit (chunk by chunk) and
out at fetch, so the layers above (connector, caches, orchestrator) can be
unit tested in milliseconds. The contract tests run against it and against
the real p2p and store transports alike. Registration is bookkeeping only.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mooncake_diffusion.errors import AlreadyConsumedError, PayloadGoneError
from mooncake_diffusion.memory.registration import Registrations
from mooncake_diffusion.memory.tensors import Region
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.transports.base import Plan, Transport
from mooncake_diffusion.wire.schema import LeaseMode, MemorySource, PayloadHandle

__all__ = ["MemoryTransport", "fabric_keys"]


@dataclass
class _Entry:
    blobs: list[bytearray]
    lease: LeaseMode
    committed: set[int] = field(default_factory=set)


_FABRIC: dict[str, _Entry] = {}
_CONSUMED: set[str] = set()
_LOCK = threading.Condition()


def fabric_keys() -> list[str]:
    """Payload ids the fabric holds (the fake's equivalent of the store's keys)."""
    with _LOCK:
        return sorted(_FABRIC)


def _address(blob: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(blob)).from_buffer(blob)) if blob else 0


class MemoryTransport(Transport):
    name = "memory"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self.regs = Registrations(lambda p, n, d: None, lambda p: None)

    def prepare(
        self, payload_id: str, regions: Sequence[Region], lease: LeaseMode, plan: Plan
    ) -> MemorySource:
        with _LOCK:
            _FABRIC[payload_id] = _Entry([bytearray(r.nbytes) for r in regions], lease)
        return MemorySource("local")

    def commit(
        self,
        payload_id: str,
        source: object,
        regions: Sequence[Region],
        lease: LeaseMode,
        plan: Plan,
        chunk: int,
    ) -> None:
        with _LOCK:
            entry = _FABRIC.get(payload_id)
            if entry is None:  # discarded meanwhile
                return
            for s in plan[chunk]:
                dst = _address(entry.blobs[s.tensor]) + s.offset
                ctypes.memmove(dst, regions[s.tensor].ptr + s.offset, s.length)
            entry.committed.add(chunk)
            _LOCK.notify_all()

    def discard(self, handle: PayloadHandle) -> None:
        with _LOCK:
            _FABRIC.pop(handle.payload_id, None)
            _LOCK.notify_all()

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
        pid = handle.payload_id
        with _LOCK:
            if pid in _CONSUMED:
                raise AlreadyConsumedError(f"payload {pid} was consumed")
            if pid not in _FABRIC:
                raise PayloadGoneError(f"payload {pid} is not in the fabric")
            if handle.lease == "delete_on_consume":
                _CONSUMED.add(pid)  # claimed by this fetch
        for chunk, segments in enumerate(plan):
            with _LOCK:
                while True:
                    entry = _FABRIC.get(pid)
                    if entry is None:
                        raise PayloadGoneError(f"payload {pid} was withdrawn")
                    if chunk in entry.committed:
                        break
                    if not _LOCK.wait(max(deadline - time.monotonic(), 0)):
                        raise PayloadGoneError(f"payload {pid} chunk {chunk} not there in time")
                for s in segments:
                    src = _address(entry.blobs[s.tensor]) + s.offset
                    ctypes.memmove(regions[s.tensor].ptr + s.offset, src, s.length)
            on_chunk(chunk)
        if handle.lease == "delete_on_consume":
            with _LOCK:
                _FABRIC.pop(pid, None)
        return "memory"

    def remove_request(self, request_id: str) -> int:
        """Drop every payload of ``request_id``, whoever published it (as the store
        transport does: the fabric, like the store host, outlives producers)."""
        with _LOCK:
            gone = [k for k in _FABRIC if k.startswith(f"{request_id}/")]
            for k in gone:
                del _FABRIC[k]
        return len(gone)

    def pin(self, region: Region) -> None:
        self.regs.pin(region)

    def unpin(self, region: Region) -> None:
        self.regs.unpin(region)

    def registered(self) -> tuple[int, int, int]:
        return self.regs.count, self.regs.nbytes, self.regs.temporary

    def close(self) -> None:
        self.regs.close()

"""An in-process fake transport that obeys the transport contract exactly.

Bytes are copied into a process-wide "fabric" dict at commit and out at
fetch, so the layers above (connector, caches, orchestrator) can be unit
tested in milliseconds. The contract tests run against it and against the
real p2p and store transports alike. Registration is bookkeeping only.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

from mooncake_diffusion.errors import AlreadyConsumedError, PayloadGoneError
from mooncake_diffusion.registration import Registrations
from mooncake_diffusion.schema import LeaseMode, MemorySource, PayloadHandle
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.tensors import Region
from mooncake_diffusion.transports.base import Transport

__all__ = ["MemoryTransport", "fabric_keys"]

_FABRIC: dict[str, tuple[list[bytes] | None, LeaseMode]] = {}
_CONSUMED: set[str] = set()
_LOCK = threading.Condition()


def fabric_keys() -> list[str]:
    """Payload ids the fabric holds (the fake's equivalent of the store's keys)."""
    with _LOCK:
        return sorted(_FABRIC)


class MemoryTransport(Transport):
    name = "memory"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self.regs = Registrations(lambda p, n, d: None, lambda p: None)
        self._mine: set[str] = set()

    def prepare(self, payload_id: str, regions: Sequence[Region], lease: LeaseMode) -> MemorySource:
        with _LOCK:
            _FABRIC[payload_id] = (None, lease)  # announced, bytes not there yet
            self._mine.add(payload_id)
        return MemorySource("local")

    def commit(
        self, payload_id: str, source: object, regions: Sequence[Region], lease: LeaseMode
    ) -> None:
        blobs = [ctypes.string_at(r.ptr, r.nbytes) for r in regions]
        with _LOCK:
            if payload_id in _FABRIC:  # not discarded meanwhile
                _FABRIC[payload_id] = (blobs, lease)
            _LOCK.notify_all()

    def discard(self, handle: PayloadHandle) -> None:
        with _LOCK:
            _FABRIC.pop(handle.payload_id, None)
            self._mine.discard(handle.payload_id)

    def fetch(self, handle: PayloadHandle, regions: Sequence[Region], deadline: float) -> None:
        with _LOCK:
            while True:
                entry = _FABRIC.get(handle.payload_id)
                if entry is None:
                    if handle.payload_id in _CONSUMED:
                        raise AlreadyConsumedError(f"payload {handle.payload_id} was consumed")
                    raise PayloadGoneError(f"payload {handle.payload_id} is not in the fabric")
                if entry[0] is not None:
                    break
                if not _LOCK.wait(max(deadline - time.monotonic(), 0)):
                    raise PayloadGoneError(f"payload {handle.payload_id} not committed in time")
            blobs, lease = entry
            if lease == "delete_on_consume":
                del _FABRIC[handle.payload_id]
                _CONSUMED.add(handle.payload_id)
        for r, blob in zip(regions, blobs, strict=True):
            ctypes.memmove(r.ptr, blob, len(blob))

    def pin(self, region: Region) -> None:
        self.regs.pin(region)

    def unpin(self, region: Region) -> None:
        self.regs.unpin(region)

    def registered(self) -> tuple[int, int, int]:
        return self.regs.count, self.regs.nbytes, self.regs.temporary

    def close(self) -> None:
        self.regs.close()

"""Registered host scratch that turns a many-range store object into one range.

A chunk cut along an inner dim is many byte ranges (one per outer index: 16 for
a ``[1, 16, T, H, W]`` latent cut along T). Mooncake moves each range of a
multi-buffer put or get as a transfer of its own, and on TCP each costs about as
much as a small object, so the store transport gathers such an object into one
contiguous scratch buffer before the put and scatters it after the get (a host
memcpy of the object's bytes, much cheaper than those transfers; see
``docs/performance.md``, "Pipelined store relay").

Calls, in order: ``ScratchPool(regs)`` once per store client; ``take(nbytes)``
per object (any thread), then ``give(scratch)`` once the put or get returned;
``close()`` once, before the client closes. Buffers are registered with ``regs``
(pinned: they count in ``registered()``) for as long as the pool keeps them; idle
ones beyond ``idle_bytes`` are unregistered and freed at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from mooncake_diffusion.registration import Registrations
from mooncake_diffusion.tensors import Region

__all__ = ["MIN_BYTES", "Scratch", "ScratchPool"]

#: the smallest buffer made (sizes are rounded up to a power of two from here)
MIN_BYTES = 1 << 16


@dataclass(eq=False)
class Scratch:
    """One registered host buffer; ``ptr`` is valid until it is given back."""

    region: Region

    @property
    def ptr(self) -> int:
        return self.region.ptr

    @property
    def nbytes(self) -> int:
        return self.region.nbytes


def _size_class(nbytes: int) -> int:
    return max(MIN_BYTES, 1 << max(nbytes - 1, 0).bit_length())


class ScratchPool:
    """Reusable registered scratch buffers, thread-safe. ``take`` never blocks on
    another taker: it makes (and registers) a new buffer when none is idle."""

    def __init__(self, regs: Registrations, idle_bytes: int = 64 << 20) -> None:
        self._regs = regs
        self._idle_bytes = idle_bytes
        self._idle: dict[int, list[Scratch]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, nbytes: int) -> Scratch:
        """A registered buffer of at least ``nbytes``, owned by the caller until
        ``give``. Raises what registration raises (the buffer is freed then)."""
        size = _size_class(nbytes)
        with self._lock:
            free = self._idle.get(size)
            if free:
                return free.pop()
        arr = np.empty(size, np.uint8)
        arr.fill(0)  # fault the pages in now, not inside the first transfer
        region = Region(arr.ctypes.data, size, arr)
        self._regs.pin(region)
        return Scratch(region)

    def give(self, scratch: Scratch) -> None:
        """Return a buffer from ``take``; kept for reuse within ``idle_bytes``."""
        with self._lock:
            if not self._closed and self.idle_nbytes + scratch.nbytes <= self._idle_bytes:
                self._idle.setdefault(scratch.nbytes, []).append(scratch)
                return
        self._regs.unpin(scratch.region)

    def idle(self) -> tuple[int, int]:
        """How many buffers are kept for reuse, and their bytes (a consistent snapshot)."""
        with self._lock:
            return sum(len(free) for free in self._idle.values()), self.idle_nbytes

    @property
    def idle_nbytes(self) -> int:
        return sum(s.nbytes for free in self._idle.values() for s in free)

    def close(self) -> None:
        """Unregister every idle buffer; buffers given back later are dropped too."""
        with self._lock:
            self._closed = True
            idle = [s for free in self._idle.values() for s in free]
            self._idle.clear()
        for s in idle:
            self._regs.unpin(s.region)

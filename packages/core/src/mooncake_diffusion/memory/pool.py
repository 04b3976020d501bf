"""Connector-owned receive memory: one buffer, allocated once, carved first-fit.

Used when ``consume()`` gets no ``dst``. The buffer is registered once per
transport; allocations are 256-byte aligned. A request larger than the free
space gets ``None`` and the caller falls back to a one-off buffer. Thread-safe.
"""

from __future__ import annotations

import threading

__all__ = ["FreeList"]

ALIGN = 256


class FreeList:
    """First-fit allocator over ``[0, capacity)`` with coalescing frees."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` of free space, or ``None`` if no hole is large enough."""
        size = max((nbytes + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, length - size)
                    self._used[off] = size
                    return off
        return None

    def free(self, offset: int) -> None:
        """Return an allocation; freeing an unknown offset raises ``KeyError``."""
        with self._lock:
            size = self._used.pop(offset)
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free = merged

    def size_of(self, offset: int) -> int:
        """The size reserved for the allocation at ``offset`` (0 if none)."""
        with self._lock:
            return self._used.get(offset, 0)

    @property
    def used(self) -> int:
        return sum(self._used.values())

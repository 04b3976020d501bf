"""Receive memory that is handed out fresh and comes back when the caller drops it.

A consumer that must return new tensors (a key-addressed ``get`` owns what it
returns) pays three things per receive when it allocates each time: the
allocation, the registration with the transport, and the first-touch page
faults of the transfer writing into it. On a 64 MiB payload over loopback the
faults alone cost more than the copy. ``RecycledBuffers`` keeps host buffers
registered and already faulted in, and hands each out as a numpy array that
owns nothing but a reference to the buffer: once every tensor and view made
from it is gone (a finaliser on that array), the buffer is free for the next
receive. Nothing is reused while any view of it is alive, so a caller never sees
its data change.

    bufs = RecycledBuffers(register, unregister, idle_bytes=512 << 20)
    arr = bufs.take(nbytes)      # uint8 array of exactly nbytes, registered
    ... receive into arr, return views of it to the caller ...
    bufs.close()                 # unregisters; arrays still held stay valid

Idle buffers beyond ``idle_bytes`` are unregistered and freed on the next
``take`` (never in the finaliser, which runs wherever the last reference died).
Thread-safe. The finaliser takes no lock: it can run inside any allocation,
including one this pool makes while holding its own lock (the cyclic garbage
collector runs finalisers of whatever it frees, on the thread that allocated),
so it only appends the buffer to a queue that every other call empties first.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["RecycledBuffers"]

_PAGE = 2 << 20  # capacities rounded to a huge page: fewer distinct sizes, THP-friendly


@dataclass(eq=False)
class _Buffer:
    mem: mmap.mmap
    base: np.ndarray  # the whole mapping, uint8; registered
    capacity: int


class RecycledBuffers:
    """A bounded cache of registered host buffers (see the module docstring).

    ``register(arr)`` / ``unregister(arr)`` are called with the whole buffer's
    uint8 array (e.g. ``DiffusionConnector.register`` / ``unregister``).
    """

    def __init__(
        self,
        register: Callable[[np.ndarray], None],
        unregister: Callable[[np.ndarray], None],
        *,
        idle_bytes: int = 512 << 20,
    ) -> None:
        self._register = register
        self._unregister = unregister
        self.idle_bytes = idle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Buffer] = []  # free, registered, faulted in
        self._busy: set[_Buffer] = set()  # handed out, a finaliser pending
        self._returns: collections.deque[_Buffer] = collections.deque()  # finalised, not yet idle
        self._closed = False
        self.allocations = 0  # buffers ever made (a test sees reuse through it)

    def take(self, nbytes: int) -> np.ndarray:
        """A registered uint8 array of ``nbytes`` (>= 1), whose buffer is reused only
        after this array and everything made from it are gone."""
        nbytes = max(nbytes, 1)
        with self._lock:
            if self._closed:
                raise RuntimeError("recycled buffers are closed")
            self._collect()
            fits = [b for b in self._idle if b.capacity >= nbytes]
            buf = min(fits, key=lambda b: b.capacity) if fits else None
            if buf is not None:
                self._idle.remove(buf)
            drop = self._over_budget(0 if buf is not None else nbytes)
        for old in drop:
            self._free(old)
        if buf is None:
            buf = self._new(nbytes)
        arr = np.frombuffer(buf.mem, dtype=np.uint8, count=nbytes)
        with self._lock:
            self._busy.add(buf)
        weakref.finalize(arr, self._returned, buf)
        return arr

    def _over_budget(self, incoming: int) -> list[_Buffer]:
        """Idle buffers to free so idle bytes stay within budget (lock held)."""
        drop = []
        total = sum(b.capacity for b in self._idle)
        while self._idle and total > max(self.idle_bytes - incoming, 0):
            old = max(self._idle, key=lambda b: b.capacity)
            self._idle.remove(old)
            total -= old.capacity
            drop.append(old)
        return drop

    def _new(self, nbytes: int) -> _Buffer:
        capacity = -(-nbytes // _PAGE) * _PAGE
        mem = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):  # no THP: ordinary pages
            mem.madvise(mmap.MADV_HUGEPAGE)
        base = np.frombuffer(mem, dtype=np.uint8)
        self._register(base)
        self.allocations += 1
        return _Buffer(mem, base, capacity)

    def _returned(self, buf: _Buffer) -> None:
        """The finaliser: lock-free (see the module docstring); deque appends are atomic.
        After ``close`` nothing is reused, so nothing is kept."""
        if not self._closed:
            self._returns.append(buf)

    def _collect(self) -> None:
        """Buffers whose arrays are gone become idle (lock held)."""
        while self._returns:
            buf = self._returns.popleft()
            self._busy.discard(buf)
            if not self._closed:
                self._idle.append(buf)

    def _free(self, buf: _Buffer) -> None:
        with contextlib.suppress(Exception):
            self._unregister(buf.base)

    @property
    def idle(self) -> int:
        """Bytes of idle (reusable) buffers."""
        with self._lock:
            self._collect()
            return sum(b.capacity for b in self._idle)

    @property
    def idle_count(self) -> int:
        """Idle (reusable) buffers."""
        with self._lock:
            self._collect()
            return len(self._idle)

    @property
    def busy(self) -> int:
        """Buffers handed out whose arrays are still alive."""
        with self._lock:
            self._collect()
            return len(self._busy)

    def close(self) -> None:
        """Unregister every buffer. Arrays still held stay valid (their memory stays
        mapped until they go); none is reused. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._collect()
            self._closed = True
            bufs, self._idle = self._idle + list(self._busy), []
            self._busy = set()
        for buf in bufs:
            self._free(buf)

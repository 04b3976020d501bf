"""Register-once bookkeeping for memory handed to a Transfer Engine or Store client.

Mooncake's engine rejects a registration that overlaps an existing one (-7),
and registering on RDMA costs far more than a transfer, so every region is
registered by its whole allocation, once, and shared by refcount:

    regs = Registrations(register_fn, unregister_fn)   # owner: one transport
    regs.pin(region)            # caller-registered buffer: kept until close()
    lease = regs.acquire(region)  # covered by a pin or registered temporarily
    ...transfer...
    regs.release(lease)         # unregisters when the last temporary user goes
    regs.close()                # unregisters everything left

Thread-safe. ``register_fn(ptr, nbytes, device)`` and ``unregister_fn(ptr)``
raise on failure; they are the Mooncake wrappers' methods.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mooncake_diffusion.errors import TransferError
from mooncake_diffusion.memory.tensors import Region

__all__ = ["Registrations"]

_EMPTY = -1  # the lease of a zero-byte region, which needs no registration


@dataclass
class _Entry:
    ptr: int
    nbytes: int
    refs: int
    pinned: bool


class Registrations:
    """The set of registered extents of one engine or store client."""

    def __init__(
        self,
        register_fn: Callable[[int, int, str], None],
        unregister_fn: Callable[[int], None],
    ) -> None:
        self._register = register_fn
        self._unregister = unregister_fn
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()

    def _covering(self, ptr: int, nbytes: int) -> _Entry | None:
        for e in self._entries.values():
            if e.ptr <= ptr and ptr + nbytes <= e.ptr + e.nbytes:
                return e
            if ptr < e.ptr + e.nbytes and e.ptr < ptr + nbytes:
                raise TransferError(
                    f"memory [{ptr:#x}, +{nbytes}) partly overlaps a registered region "
                    f"[{e.ptr:#x}, +{e.nbytes}); register the whole allocation instead"
                )
        return None

    def pin(self, region: Region) -> None:
        """Keep ``region``'s allocation registered until ``unpin`` or ``close``."""
        ptr, nbytes = region.extent
        with self._lock:
            entry = self._covering(ptr, nbytes)
            if entry is None:
                self._register(ptr, nbytes, region.device)
                self._entries[ptr] = _Entry(ptr, nbytes, 0, True)
            else:
                entry.pinned = True

    def unpin(self, region: Region) -> None:
        """Drop a pin; the extent is unregistered once no transfer uses it."""
        ptr, nbytes = region.extent
        with self._lock:
            entry = self._covering(ptr, nbytes)
            if entry is not None:
                entry.pinned = False
                self._drop_if_unused(entry)

    def acquire(self, region: Region) -> int:
        """Make ``region`` registered for one transfer; returns a lease for ``release``."""
        if region.nbytes == 0:
            return _EMPTY
        ptr, nbytes = region.extent
        with self._lock:
            entry = self._covering(ptr, nbytes)
            if entry is None:
                self._register(ptr, nbytes, region.device)
                entry = self._entries[ptr] = _Entry(ptr, nbytes, 0, False)
            entry.refs += 1
            return entry.ptr

    def release(self, lease: int) -> None:
        """End one ``acquire``; the lease of an empty region is ignored."""
        if lease == _EMPTY:
            return
        with self._lock:
            entry = self._entries.get(lease)
            if entry is not None:
                entry.refs -= 1
                self._drop_if_unused(entry)

    def _drop_if_unused(self, entry: _Entry) -> None:
        if entry.refs <= 0 and not entry.pinned:
            del self._entries[entry.ptr]
            self._unregister(entry.ptr)

    @contextlib.contextmanager
    def held(self) -> Iterator[list[tuple[int, int]]]:
        """Hold the set still: yields every registered extent as ``(ptr, nbytes)``, and
        no ``pin``/``acquire``/``release`` changes it until the block ends (the store
        client registers them all on a fresh client and swaps inside it)."""
        with self._lock:
            yield [(e.ptr, e.nbytes) for e in self._entries.values()]

    @property
    def count(self) -> int:
        """Registered extents right now (leak checks compare this with a baseline)."""
        return len(self._entries)

    @property
    def temporary(self) -> int:
        """Extents registered for a transfer, not pinned: 0 whenever nothing is in flight."""
        return sum(1 for e in self._entries.values() if not e.pinned)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def close(self) -> None:
        """Unregister everything; errors from the engine are ignored at shutdown."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            with contextlib.suppress(Exception):
                self._unregister(e.ptr)

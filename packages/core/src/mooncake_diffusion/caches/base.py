"""What both caches share: a Store client, the entry codec, counters, lifecycle.

A cache holds one ``StoreClient`` (its own, or one passed in and left open),
one pinned metadata scratch and nothing else between calls: each lookup or
write registers the caller's tensors for the duration of the call only, unless
the caller pinned them with ``register()``.

Errors. Input that cannot form a key or an entry raises before the store is
touched (``CacheKeyError``, ``PayloadError``). A stored entry of another
encoder/model or a corrupt one raises (``CacheMismatchError``,
``CacheEntryError``). Store failures (full pool, dead store host, leases) raise
from the strict calls and are absorbed, counted and logged by the best-effort
ones, which then behave as a miss or a skipped write.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.caches.entry import (
    CacheStats,
    Counters,
    EntryMeta,
    EntryStore,
    Owner,
    named_tensors,
)
from mooncake_diffusion.caches.errors import CacheMismatchError
from mooncake_diffusion.errors import MooncakeDiffusionError, PayloadError
from mooncake_diffusion.memory.tensors import check_destination, describe
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["StoreCache"]

_log = logging.getLogger("mooncake_diffusion.caches")


class StoreCache:
    """Base of ``EmbeddingCache`` and ``CfgCache``; not used directly."""

    def __init__(
        self,
        settings: MooncakeSettings,
        owner: Owner,
        namespace: str,
        *,
        device: str = "cpu",
        client: StoreClient | None = None,
    ) -> None:
        self._owner = owner
        self.namespace = namespace
        self._own_client = client is None
        self.client = client if client is not None else StoreClient(settings)
        try:
            self._entries = EntryStore(self.client, device=device)
        except BaseException:
            if self._own_client:
                self.client.close()
            raise
        self._counters = Counters()
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def register(self, tensor: Any) -> None:
        """Keep ``tensor``'s memory registered until ``unregister``/``close``: for buffers
        reused as ``dst`` or written from on every call (saves a registration per call)."""
        self.client.regs.pin(describe("tensor", tensor)[1])

    def unregister(self, tensor: Any) -> None:
        self.client.regs.unpin(describe("tensor", tensor)[1])

    def stats(self) -> CacheStats:
        """A snapshot of the counters (hits, misses, bytes, puts, errors)."""
        return self._counters.snapshot()

    def clear(self) -> int:
        """Remove every entry under this cache's namespace, written by any process, and
        return how many store objects went. Readers in flight see a miss."""
        return self.client.remove_prefix(self.namespace)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop this cache's registrations and, if it made its client, close it (~1 s).
        Entries stay in the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._entries.close()
        if self._own_client:
            self.client.close()

    def __enter__(self) -> StoreCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _count_failure(self, e: MooncakeDiffusionError, absorb: bool, what: str) -> None:
        """Count a failure of the store or of a stored entry; re-raise unless a
        best-effort call may absorb it (retryable store errors only)."""
        if isinstance(e, PayloadError) and not isinstance(e, CacheMismatchError):
            raise e  # the caller's own input (e.g. a dst of the wrong shape)
        self._counters.error(e)
        if not (absorb and e.retryable):
            raise e
        _log.warning("cache of %s: %s: %s", self._owner.describe(), what, e)

    def _lookup(
        self, key: str, dst: Any, *, absorb: bool
    ) -> tuple[EntryMeta | None, dict[str, Any] | None]:
        """(metadata or None, tensors or None); counts one hit or one miss."""
        meta, tensors = None, None
        try:
            meta = self._entries.read_meta(key, self._owner)
            if meta is not None:
                tensors = self._entries.read_data(meta, dst)
        except MooncakeDiffusionError as e:
            self._count_failure(e, absorb, "lookup failed, treated as a miss")
        if tensors is None:
            self._counters.add(misses=1)
        else:
            assert meta is not None
            self._counters.add(hits=1, bytes_read=meta.data_bytes)
        return meta, tensors

    def _store(self, key: str, tensors: Any, *, absorb: bool, stale: EntryMeta | None) -> bool:
        """Write one entry; ``stale`` is metadata found without its data, replaced
        when its layout differs. Returns whether the entry is now in the store."""
        meta, regions = self._entries.prepare(key, self._owner, tensors)
        try:
            if stale is not None and stale.layout() != meta.layout():
                self._entries.remove(key)
            self._entries.write(meta, regions)
        except MooncakeDiffusionError as e:
            self._count_failure(e, absorb, "write failed, entry not stored")
            return False
        self._counters.add(puts=1, bytes_written=meta.data_bytes)
        return True

    @staticmethod
    def _into(dst: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        """Copy freshly computed ``tensors`` into the caller's ``dst`` (validated)."""
        if len(tensors) == 1 and not isinstance(dst, Mapping):
            dst = {next(iter(tensors)): dst}
        targets = named_tensors(dst, "dst")
        if set(targets) != set(tensors):
            raise PayloadError(f"dst names {sorted(targets)} differ from {sorted(tensors)}")
        for name, t in tensors.items():
            check_destination(describe(name, t)[0], targets[name])
            d = targets[name]
            if hasattr(d, "copy_"):
                d.copy_(t)
            else:
                d[...] = t
        return {name: targets[name] for name in tensors}

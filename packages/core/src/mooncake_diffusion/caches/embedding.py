"""Condition-embedding cache: encode a prompt once per cluster, not once per process.

Call sequence (an encode worker; every call blocks, none starts a thread):

    cache = EmbeddingCache(settings, encoder_id="t5-v1_1-xxl", encoder_version="1.0")
    embeds, hit = cache.get_or_compute(prompt, {"max_length": 512},
                                       lambda: {"prompt_embeds": t5(prompt)})
    ...                                 # embeds: tensors the caller owns
    cache.key(prompt, params)           # the key, e.g. to hand to CfgCache or a peer
    cache.get_by_key(key)               # a key that arrived in a message
    cache.stats()                       # hits, misses, bytes_read, bytes_written, ...
    cache.close()

Entries are keyed by ``keys.embedding_key`` (the recipe other engines follow),
shared by every process of the cluster through Mooncake Store, soft-pinned and
evictable: any lookup may miss, and ``get_or_compute`` then computes and puts
again. Two processes computing one key at once is safe (the first put of each
object wins; both are equivalent).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.caches.base import StoreCache
from mooncake_diffusion.caches.entry import Owner, named_tensors
from mooncake_diffusion.caches.errors import CacheKeyError, CacheMismatchError
from mooncake_diffusion.caches.keys import embedding_key, embedding_namespace, is_embedding_key
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["EmbeddingCache"]

Params = Mapping[str, Any] | None


class EmbeddingCache(StoreCache):
    """Embeddings of one encoder id and version, shared through Mooncake Store.

    ``encoder_version`` must change whenever the encoder's weights or code change
    its output: it is hashed into every key, so entries of another version are
    never read. ``device`` is where tensors the cache allocates live (a ``dst``
    passed to a call overrides it). ``client``: share a ``StoreClient`` (left
    open by ``close``); by default the cache connects its own (~0.1 s).
    Thread-safe.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        encoder_id: str,
        encoder_version: str,
        device: str = "cpu",
        client: StoreClient | None = None,
    ) -> None:
        namespace = embedding_namespace(encoder_id, encoder_version)  # validates both
        super().__init__(
            settings,
            Owner("emb", encoder_id, encoder_version),
            namespace,
            device=device,
            client=client,
        )
        self.encoder_id = encoder_id
        self.encoder_version = encoder_version

    def key(self, prompt: str, params: Params = None) -> str:
        """The entry key of ``(prompt, params)``; raises ``CacheKeyError`` for params that
        are not JSON values (NaN, bytes, tensors, huge ints). No I/O."""
        return embedding_key(self.encoder_id, self.encoder_version, prompt, params)

    def check_key(self, key: str) -> None:
        """Raise ``CacheMismatchError`` unless ``key`` is an embedding key of this encoder
        id and version (``CacheKeyError`` if it is no embedding key at all)."""
        if not is_embedding_key(key):
            raise CacheKeyError(f"{key!r} is not an embedding-cache key")
        if not key.startswith(self.namespace):
            raise CacheMismatchError(
                f"key {key!r} was built for another encoder id or version than "
                f"{self.encoder_id!r} version {self.encoder_version!r}"
            )

    def get(self, prompt: str, params: Params = None, *, dst: Any = None) -> dict[str, Any] | None:
        """The cached tensors, or ``None`` on a miss (absent, evicted, being written).

        Tensors land in ``dst`` (a tensor, or a dict by name, validated against the
        entry) or in one new buffer the caller then owns. Raises on store failures
        and on foreign or corrupt entries (``CacheMismatchError``, ``CacheEntryError``).
        """
        return self._lookup(self.key(prompt, params), dst, absorb=False)[1]

    def get_by_key(self, key: str, *, dst: Any = None) -> dict[str, Any] | None:
        """``get`` for a key computed elsewhere; checked first with ``check_key``."""
        self.check_key(key)
        return self._lookup(key, dst, absorb=False)[1]

    def put(self, prompt: str, params: Params, tensors: Any) -> str:
        """Store ``tensors`` (a contiguous tensor or a dict of them) for ``(prompt,
        params)`` and return the key. An existing entry is left as it is. Raises
        before writing anything on bad input; on a store failure nothing of this
        call is left behind and the error (e.g. ``StoreFullError``) is raised."""
        key = self.key(prompt, params)
        self._store(key, tensors, absorb=False, stale=None)
        return key

    def get_or_compute(
        self,
        prompt: str,
        params: Params,
        compute: Callable[[], Any],
        *,
        dst: Any = None,
    ) -> tuple[dict[str, Any], bool]:
        """``(tensors, hit)``: the cached entry, or on a miss ``compute()`` (a tensor or a
        dict of them), stored for the next caller.

        Never fails for the store's sake: a store that is full, unreachable or slow
        to evict costs a recompute or a skipped put (counted in ``stats().errors``).
        With ``dst`` the result is always in ``dst`` (copied there on a miss). Raises
        on bad input, on foreign or corrupt entries, and whatever ``compute`` raises.
        """
        key = self.key(prompt, params)
        meta, found = self._lookup(key, dst, absorb=True)
        if found is not None:
            return found, True
        tensors = named_tensors(compute(), "compute()'s result")
        self._store(key, tensors, absorb=True, stale=meta)
        return (tensors if dst is None else self._into(dst, tensors)), False

    def remove(self, prompt: str, params: Params = None) -> None:
        """Remove the entry of ``(prompt, params)`` for every process; absent is fine."""
        self._entries.remove(self.key(prompt, params))

"""CFG-branch cache (opt-in, best effort): unconditional-branch features by step.

Classifier-free guidance runs the denoiser twice per step, once on the negative
prompt. For a popular negative prompt the unconditional branch at a given
(step, timestep, shape) is the same in every request, so a denoise worker may
store it once and load it elsewhere. Whether reuse is acceptable (same seed and
latents, a schedule where the branch does not depend on the request) is the
framework's decision: this cache returns only an exact match of every key
field and never guesses (no nearest timestep, no reshaping).

Call sequence (a denoise worker that opted in):

    cfg = CfgCache(settings, model_id="wan2.1-t2v-14b@rev3")
    neg = emb_cache.key(negative_prompt, params)        # the negative prompt's key
    out = cfg.load(neg, step, float(t), shape=x.shape, dtype=x.dtype, dst=buf)
    if out is None:
        uncond = dit(x, t, neg_embeds)
        cfg.store(neg, step, float(t), uncond)          # shape/dtype taken from it
    cfg.stats(); cfg.clear(); cfg.close()

``store`` and ``load`` never fail for the store's sake (a full or unreachable
store is a skipped write or a miss, counted in ``stats().errors``); they raise
on bad input and on foreign or corrupt entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.caches.base import StoreCache
from mooncake_diffusion.caches.entry import Owner, named_tensors
from mooncake_diffusion.caches.errors import CacheKeyError
from mooncake_diffusion.caches.keys import cfg_key, cfg_namespace
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["CfgCache"]


class CfgCache(StoreCache):
    """Unconditional-branch features of one model (``model_id`` names the weights and
    their revision), shared through Mooncake Store. Thread-safe; see ``EmbeddingCache``
    for ``device`` and ``client``."""

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        model_id: str,
        device: str = "cpu",
        client: StoreClient | None = None,
    ) -> None:
        namespace = cfg_namespace(model_id)  # validates model_id
        super().__init__(settings, Owner("cfg", model_id), namespace, device=device, client=client)
        self.model_id = model_id

    def key(
        self, neg_key: str, step: int, timestep: float, shape: Sequence[int], dtype: Any
    ) -> str:
        """The entry key (``keys.cfg_key``); ``CacheKeyError`` on malformed fields. No I/O."""
        return cfg_key(self.model_id, neg_key, step, timestep, shape, dtype)

    def store(
        self,
        neg_key: str,
        step: int,
        timestep: float,
        tensors: Any,
        *,
        shape: Sequence[int] | None = None,
        dtype: Any = None,
    ) -> bool:
        """Store the branch's features (a contiguous tensor, or a dict of them with an
        explicit ``shape`` and ``dtype`` for the key). Returns whether the entry is in
        the store now (``False``: the store refused, e.g. full). An existing entry
        is left as it is."""
        named = named_tensors(tensors)
        if shape is None or dtype is None:
            if len(named) != 1:
                raise CacheKeyError("pass shape= and dtype= when storing several tensors")
            spec = describe(*next(iter(named.items())))[0]
            shape = spec.shape if shape is None else shape
            dtype = spec.dtype if dtype is None else dtype
        key = self.key(neg_key, step, timestep, shape, dtype)
        return self._store(key, named, absorb=True, stale=None)

    def load(
        self,
        neg_key: str,
        step: int,
        timestep: float,
        *,
        shape: Sequence[int],
        dtype: Any,
        dst: Any = None,
    ) -> dict[str, Any] | None:
        """The features stored for exactly these fields, or ``None`` (a miss: never
        stored, evicted, being written, or the store unreachable). Tensors land in
        ``dst`` (validated) or in a new buffer the caller owns."""
        key = self.key(neg_key, step, timestep, shape, dtype)
        return self._lookup(key, dst, absorb=True)[1]

    def remove(
        self, neg_key: str, step: int, timestep: float, *, shape: Sequence[int], dtype: Any
    ) -> None:
        """Remove one entry for every process; absent is fine."""
        self._entries.remove(self.key(neg_key, step, timestep, shape, dtype))

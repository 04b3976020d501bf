"""Caches in Mooncake Store: condition embeddings and CFG-branch features.

    EmbeddingCache   prompt embeddings of one encoder id + version, shared by every
                     process of the cluster; get_or_compute() encodes on a miss
    CfgCache         unconditional-branch features by (model, negative-prompt key,
                     step, timestep, shape, dtype); opt-in and best effort
    CheckpointCache  a denoise job's latent + sampler state every k steps, so any
                     worker resumes it (checkpoint.py holds its key recipe)
    CacheStats       hits, misses, bytes_read, bytes_written, puts, errors
    embedding_key    the key recipe (keys.py documents it for other engines)
    cfg_key          the CFG-branch key recipe
    canonical_json   the canonical JSON both recipes hash
    CacheKeyError, CacheMismatchError, CacheEntryError   (errors.py)

Order of calls, per worker process:

    emb = EmbeddingCache(settings, encoder_id=..., encoder_version=...)  # connects
    tensors, hit = emb.get_or_compute(prompt, params, compute)  # per request
    emb.stats()                                                 # any time
    emb.close()                                                 # at shutdown

Every entry is soft-pinned (evicted last, but evictable) and may vanish at any
time; nothing depends on an entry for correctness. ``clear()`` removes every
entry of a cache's encoder version (or model) from the store, for all processes.
Nothing here imports Mooncake or torch until a cache is constructed.
"""

from mooncake_diffusion.caches.cfg import CfgCache
from mooncake_diffusion.caches.checkpoint import CheckpointCache, CheckpointJob, checkpoint_job
from mooncake_diffusion.caches.embedding import EmbeddingCache
from mooncake_diffusion.caches.entry import CacheStats
from mooncake_diffusion.caches.errors import CacheEntryError, CacheKeyError, CacheMismatchError
from mooncake_diffusion.caches.keys import canonical_json, cfg_key, embedding_key

__all__ = [
    "CacheEntryError",
    "CacheKeyError",
    "CacheMismatchError",
    "CacheStats",
    "CfgCache",
    "CheckpointCache",
    "CheckpointJob",
    "EmbeddingCache",
    "canonical_json",
    "cfg_key",
    "checkpoint_job",
    "embedding_key",
]

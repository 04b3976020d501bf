"""Spill a full Store pool to local disk instead of failing (Mooncake's offload).

The master runs with ``SPILL_MASTER_FLAGS`` (``-enable_offload``) and the
segment owner (our store host, ``--spill-dir``) sets up its native client with
``spill_store_kwargs(dir)``. Mooncake then writes every completed put to a file
under ``dir`` in the background (eager offload, every
``MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS``, 1 s here) and records it as a
``LOCAL_DISK`` replica; when DRAM is full it evicts as usual, and an evicted
object is read back from its file (slower) instead of being gone.

The rule for what goes to disk first is Mooncake's eviction order applied to
our pins: unpinned objects leave DRAM first, oldest first; soft-pinned ones
(the caches' entries: step checkpoints, condition embeddings, CFG branches)
next; **hard-pinned ones never** (single-consumer stage payloads: latents,
decoded frames waiting for their consumer). So checkpoints spill before latents,
and a burst of hard-pinned payloads larger than DRAM still fails with
``StoreFullError`` after the retry window: spill helps what may be evicted.

Backend: ``file_per_key_storage_backend`` (one file per object). Mooncake's
default bucket backend wrote nothing within our runs' seconds (0.3.13.post1;
it groups objects into buckets of up to 256 MB or 500 keys before writing).
Disk limit: 90 % of the directory's free space at start. One live client per
directory (Mooncake's rule): one directory per store host.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["SPILL_MASTER_FLAGS", "spill_store_kwargs"]

#: the master's side of spill (offload queued at each completed put)
SPILL_MASTER_FLAGS = ("-enable_offload=true",)


def spill_store_kwargs(spill_dir: str) -> dict[str, object]:
    """The ``setup()`` keywords of a segment owner that spills to ``spill_dir``.

    Sets this process's ``MOONCAKE_OFFLOAD_*`` environment, which is where
    Mooncake's native client reads its offload settings (only a store host, which
    owns a segment, calls this)."""
    os.makedirs(spill_dir, exist_ok=True)
    limit = int(shutil.disk_usage(spill_dir).free * 0.9)
    os.environ.update(
        {
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": spill_dir,
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend",
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(limit),
        }
    )
    return {"enable_ssd_offload": True, "ssd_offload_path": spill_dir}

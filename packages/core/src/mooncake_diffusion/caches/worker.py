"""An encode worker in a child process, driven by JSON lines: the second process of
the cache tests, and a runnable example of ``EmbeddingCache`` across processes.

``python -m mooncake_diffusion.caches.worker`` reads settings from the
``MOONCAKE_*`` environment and speaks one JSON object per line:

    -> {"op": "get_or_compute", "encoder": "t5", "version": "1", "prompt": "p",
        "params": {}, "shape": [4, 8], "dtype": "float32"}
    <- {"ok": true, "hit": false, "computed": 1, "key": "mcd-cache/emb/v1/...",
        "sha256": "<hex of the tensor's bytes>"}
    -> {"op": "stats"}  <- {"ok": true, "stats": {"hits": 0, ...},
                            "registrations": 1, "temporary": 0}
    -> {"op": "exit"}   (closes its caches, exits 0)

``computed`` counts the calls of the fake encoder (``fake_encode``, deterministic
in every process) for that request: 0 on a hit. Errors come back as
``{"ok": false, "error": "<class>", "message": "..."}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from typing import Any, TextIO

from mooncake_diffusion.caches.embedding import EmbeddingCache
from mooncake_diffusion.caches.keys import canonical_json
from mooncake_diffusion.handoff.demo import make_tensor
from mooncake_diffusion.platform.childproc import JsonLinesChild, serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["EncoderProcess", "fake_encode", "tensor_digest"]


def fake_encode(prompt: str, params: dict, shape: list[int], dtype: str) -> Any:
    """A stand-in encoder: bytes determined by (prompt, params), equal in every process."""
    seed = int(hashlib.sha256(canonical_json([prompt, params]).encode()).hexdigest()[:8], 16)
    return make_tensor(dtype, shape, seed)


def tensor_digest(t: Any) -> str:
    """sha256 of a CPU tensor's bytes (dtype and shape aside)."""
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _serve(settings: MooncakeSettings, stdin: TextIO, stdout: TextIO) -> int:
    caches: dict[tuple[str, str], EmbeddingCache] = {}

    def stats(cmd: dict) -> dict:
        total = [dataclasses.asdict(c.stats()) for c in caches.values()]
        regs = [c.client.regs for c in caches.values()]
        return {
            "ok": True,
            "stats": {k: sum(s[k] for s in total) for k in ("hits", "misses", "puts")},
            "registrations": sum(r.count for r in regs),
            "temporary": sum(r.temporary for r in regs),
        }

    try:
        serve_json_lines(
            {"get_or_compute": lambda cmd: _get_or_compute(caches, settings, cmd), "stats": stats},
            stdin,
            stdout,
        )
    finally:
        for c in caches.values():
            c.close()
    return 0


def _get_or_compute(
    caches: dict[tuple[str, str], EmbeddingCache], settings: MooncakeSettings, cmd: dict
) -> dict:
    ident = (cmd["encoder"], cmd["version"])
    cache = caches.get(ident)
    if cache is None:
        cache = caches[ident] = EmbeddingCache(
            settings, encoder_id=ident[0], encoder_version=ident[1]
        )
    calls = []

    def compute() -> Any:
        calls.append(1)
        return fake_encode(cmd["prompt"], cmd.get("params", {}), cmd["shape"], cmd["dtype"])

    params = cmd.get("params", {})
    tensors, hit = cache.get_or_compute(cmd["prompt"], params, compute)
    return {
        "ok": True,
        "hit": hit,
        "computed": len(calls),
        "key": cache.key(cmd["prompt"], params),
        "sha256": tensor_digest(tensors["tensor"]),
    }


class EncoderProcess(JsonLinesChild):
    """The worker in a child process (see the module docstring)."""

    def __init__(self, settings: MooncakeSettings) -> None:
        argv = [sys.executable, "-m", "mooncake_diffusion.caches.worker"]
        super().__init__(argv, settings, "encoder worker")


def main() -> int:
    return _serve(MooncakeSettings.from_env(), sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

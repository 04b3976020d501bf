"""Toy stage functions: real connector traffic, trivial compute, for smoke tests and benches.

    mooncake-diffusion worker --stage denoise \
        --fn mooncake_diffusion.orchestrator.worker.toy:denoise

Request params they read (all optional): ``prompt`` (str), ``size`` (float32
elements of the embedding, default 1024), ``steps`` (default 4), ``step_s``
(seconds per denoise step, default 0), ``fail`` (a stage name: that stage
raises ``ValueError``, failing the request at once). The output of ``decode``
is JSON: ``{"checksum": ..., "elements": ...}``, where ``checksum`` is
``expected_checksum(params)``, so a test can check the bytes went through every
stage intact. The reference pipeline (``mooncake_diffusion.pipeline``) is the
real thing; these are for the service alone.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec
import numpy as np

from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.worker.runtime import StageContext
from mooncake_diffusion.transfer.payload import StagePayload

__all__ = ["ack", "decode", "denoise", "encode", "expected_checksum"]


def _np(t: Any) -> np.ndarray:
    """A numpy view of a received tensor (the receive pool hands out torch views)."""
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def _check_fail(item: WorkItem, params: dict[str, Any]) -> None:
    if params.get("fail") == item.stage:
        raise ValueError(f"asked to fail at {item.stage}")


def _embedding(params: dict[str, Any]) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(str(params.get("prompt", "")).encode()).digest()[:4])
    rng = np.random.default_rng(seed)
    return rng.standard_normal(int(params.get("size", 1024)), dtype=np.float32)


def expected_checksum(params: dict[str, Any]) -> float:
    """What ``decode`` reports for these params: the sum of the denoised tensor."""
    x = _embedding(params)
    for _ in range(int(params.get("steps", 4))):
        x = x * np.float32(0.5) + np.float32(1.0)
    return float(x.astype(np.float64).sum())


def encode(item: WorkItem, ctx: StageContext) -> StagePayload:
    _check_fail(item, ctx.params)
    emb = _embedding(ctx.params)
    ctx.info["bytes"] = emb.nbytes
    return StagePayload(request_id=item.request_id, kind="embedding", tensor=emb, lease="retained")


def denoise(item: WorkItem, ctx: StageContext) -> StagePayload | None:
    p = ctx.params
    _check_fail(item, p)
    with ctx.connector.consume(item.input) as got:
        x = _np(got.tensor).copy()
        ctx.info["path"] = got.path
    steps, step_s = int(p.get("steps", 4)), float(p.get("step_s", 0.0))
    for i in range(steps):
        if ctx.cancelled or ctx.should_yield:
            return None
        time.sleep(step_s)
        x = x * np.float32(0.5) + np.float32(1.0)
        ctx.progress(i + 1, steps)
    ctx.info["bytes"] = x.nbytes
    return StagePayload(request_id=item.request_id, kind="latent", tensor=x, lease="retained")


def decode(item: WorkItem, ctx: StageContext) -> bytes:
    _check_fail(item, ctx.params)
    with ctx.connector.consume(item.input) as got:
        x = _np(got.tensor)
        ctx.info["path"] = got.path
        out = {"checksum": float(x.astype(np.float64).sum()), "elements": int(x.size)}
    return msgspec.json.encode(out)


def ack(item: WorkItem, ctx: StageContext) -> bytes:
    """Do nothing: acknowledge at once (the service round-trip bench)."""
    return b""

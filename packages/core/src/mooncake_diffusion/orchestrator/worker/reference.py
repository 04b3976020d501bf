"""The reference pipeline as ``StageWorker`` stage functions (what the demo runs).

    F=mooncake_diffusion.orchestrator.worker.reference
    mooncake-diffusion worker --stage encode  --fn $F:encode
    mooncake-diffusion worker --stage denoise --fn $F:denoise
    mooncake-diffusion worker --stage decode  --fn $F:decode
    # a worker that holds several stages, and may be moved to others (``load``)
    mooncake-diffusion worker --stage encode --stage decode --fn $F

Request params (JSON): the ``GenerationParams`` fields, plus ``save`` (true: decode
writes ``<request_id>.png`` or ``.gif`` into the worker's own output folder,
``MCD_OUTPUTS``; default: no file) and ``chunks`` (temporal chunks the latent moves
and decodes in; default 4). No request chooses a path: where outputs go is the
worker's configuration, and a request that asks to save on a worker without
``MCD_OUTPUTS`` fails with that reason.
``MCD_PIPELINE_CONFIG`` (JSON of ``PipelineConfig`` fields) sizes the model;
every worker of a deployment must use the same. ``MCD_CHECKPOINT_EVERY``
(default 2) is the denoise checkpoint interval.

- encode: prompt embeddings (computed); negative-prompt embeddings through the
  ``EmbeddingCache`` in Mooncake Store (one encode per distinct negative prompt
  across the cluster). Output: ``retained`` payload of both.
- denoise: resumes the job from its newest step checkpoint if one exists (any
  worker's), checkpoints every k steps, reports progress per step, yields at a
  step boundary when preempted (``DenoisePreempted``; the job resumes from its
  checkpoint later), publishes the latent chunked along T; checkpoints are
  removed once it is published, at once when the request is cancelled while it
  runs, and when the request ends failed or cancelled later (``forget_denoise``,
  ``denoise``'s ``Resumable.forget``: the orchestrator asks a denoise worker).
- decode: consumes the latent chunk by chunk as chunks land, decodes each on the
  causal VAE stream (decode overlaps the transfer), writes the output file.
  Output (the request's result): JSON with ``frames``, ``sha256`` of all frame
  bytes, ``path`` and ``first_frame_at`` (wall time of the first decoded chunk).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from mooncake_diffusion.caches.checkpoint import CheckpointCache
from mooncake_diffusion.caches.embedding import EmbeddingCache
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.worker.runtime import StageContext
from mooncake_diffusion.pipeline.checkpointing import checkpoint_job_of, denoise_with_checkpoints
from mooncake_diffusion.pipeline.params import GenerationParams, PipelineConfig
from mooncake_diffusion.pipeline.reference import DenoisePreempted, ReferencePipeline
from mooncake_diffusion.pipeline.writers import write_frames
from mooncake_diffusion.transfer.payload import StagePayload

__all__ = [
    "OUTPUTS_ENV",
    "decode",
    "denoise",
    "encode",
    "forget_denoise",
    "frames_digest",
    "generation_params",
    "load",
    "outputs_folder",
    "pipeline",
]

CONFIG_ENV = "MCD_PIPELINE_CONFIG"
EVERY_ENV = "MCD_CHECKPOINT_EVERY"
OUTPUTS_ENV = "MCD_OUTPUTS"
_EXTRA = ("save", "chunks")
_lock = threading.Lock()
_pipes: dict[str, ReferencePipeline] = {}
_caches: dict[str, Any] = {}


def pipeline() -> ReferencePipeline:
    """This process's pipeline, built once from ``MCD_PIPELINE_CONFIG``."""
    raw = os.environ.get(CONFIG_ENV, "{}")
    with _lock:
        if raw not in _pipes:
            _pipes[raw] = ReferencePipeline(msgspec.convert(json.loads(raw), PipelineConfig))
        return _pipes[raw]


def load(stage: str) -> None:
    """Load ``stage``'s model into this process: what a worker the orchestrator moved
    to ``stage`` does before it serves it (the worker times this call and reports
    it as the stage change's load cost). The reference models come from a seed,
    not from weight files, and one ``ReferencePipeline`` holds all three, so this
    builds the pipeline afresh (what its constructor does) and serves from it: the
    same bytes as before, and a floor on what loading real weights costs."""
    if stage not in ("encode", "denoise", "decode"):
        raise ValueError(f"unknown stage {stage!r}")
    raw = os.environ.get(CONFIG_ENV, "{}")
    fresh = ReferencePipeline(msgspec.convert(json.loads(raw), PipelineConfig))
    with _lock:
        _pipes[raw] = fresh


def generation_params(params: dict[str, Any]) -> GenerationParams:
    """The ``GenerationParams`` of request params (the extra keys dropped). Raises
    ``ParamsError`` / ``msgspec.ValidationError`` (a ``ValueError``: fails the request)."""
    fields = {k: v for k, v in params.items() if k not in _EXTRA}
    return msgspec.convert(fields, GenerationParams)


def frames_digest(frames: torch.Tensor) -> str:
    """sha256 of the frames' bytes (uint8 ``[F, H, W, 3]``)."""
    return hashlib.sha256(frames.contiguous().numpy().tobytes()).hexdigest()


def _cache(kind: str, ctx: StageContext) -> Any:
    pipe = pipeline()
    key = f"{kind}:{pipe.model_id}"
    with _lock:
        if key not in _caches:
            settings = ctx.connector.settings
            if kind == "emb":
                _caches[key] = EmbeddingCache(
                    settings, encoder_id=pipe.encoder_id, encoder_version="1"
                )
            else:
                every = int(os.environ.get(EVERY_ENV, "2"))
                _caches[key] = CheckpointCache(
                    settings, model_id=pipe.model_id, sampler=pipe.sampler, every=every
                )
        return _caches[key]


def encode(item: WorkItem, ctx: StageContext) -> StagePayload:
    params = generation_params(ctx.params)
    pipe = pipeline()
    tensors = {"prompt_embeds": pipe.encode(params.prompt)["embeds"]}
    if params.cfg:
        neg, hit = _cache("emb", ctx).get_or_compute(
            params.negative_prompt, {}, lambda: pipe.encode(params.negative_prompt)
        )
        tensors["negative_embeds"] = neg["embeds"]
        ctx.info["cache_hit"] = hit
    ctx.info["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    return StagePayload(
        request_id=item.request_id, kind="embedding", tensors=tensors, lease="retained"
    )


def denoise(item: WorkItem, ctx: StageContext) -> StagePayload | None:
    params = generation_params(ctx.params)
    pipe = pipeline()
    t0 = time.perf_counter()
    with ctx.connector.consume(item.input) as got:
        cond = {k: v.clone() for k, v in got.tensors.items()}
        ctx.info["in_path"] = got.path
    ctx.info["in_s"] = time.perf_counter() - t0
    cache = _cache("ckpt", ctx)
    try:
        result = denoise_with_checkpoints(
            pipe,
            cache,
            cond,
            params,
            on_step=lambda k, _state: ctx.progress(k, params.steps),
            should_stop=lambda _k: ctx.cancelled or ctx.should_yield,
        )
    except DenoisePreempted:
        if ctx.cancelled:  # nobody resumes a cancelled job: its checkpoints go now
            forget_denoise(item, ctx)
        raise
    ctx.info["resumed_from"] = result.resumed_from
    ctx.info["checkpoints"] = len(result.saved)
    latent = result.latent.contiguous()
    ctx.info["bytes"] = latent.numel() * latent.element_size()
    cache.finish(result.job)
    chunks = max(1, min(int(ctx.params.get("chunks", 4)), latent.shape[2]))
    return StagePayload(
        request_id=item.request_id,
        kind="latent",
        tensor=latent,
        lease="retained",
        chunk_dim=2,
        num_chunks=chunks,
    )


def forget_denoise(item: WorkItem, ctx: StageContext) -> None:
    """Remove the step checkpoints of ``item``'s denoise job: its request is cancelled
    or failed, nobody resumes it (``denoise.forget``, see ``worker.runtime.Resumable``)."""
    params = generation_params(ctx.params)
    pipe = pipeline()
    cache = _cache("ckpt", ctx)
    cache.finish(checkpoint_job_of(cache, pipe, params))


denoise.forget = forget_denoise  # type: ignore[attr-defined]


def decode(item: WorkItem, ctx: StageContext) -> bytes:
    params = generation_params(ctx.params)
    pipe = pipeline()
    stream = pipe.decode_stream()
    parts: list[torch.Tensor] = []
    first_at = None
    in_s, t = 0.0, time.perf_counter()  # in_s: time spent waiting for chunks, not decoding
    with ctx.connector.consume(item.input) as got:
        for chunk in got:
            in_s += time.perf_counter() - t
            parts.append(pipe.decode_feed(stream, chunk.tensor))
            first_at = first_at or time.time()
            t = time.perf_counter()
        ctx.info["in_path"] = got.path
    ctx.info["in_s"] = in_s
    frames = torch.cat(parts)
    out: dict[str, Any] = {
        "frames": int(frames.shape[0]),
        "sha256": frames_digest(frames),
        "first_frame_at": first_at,
        "video": params.is_video,
    }
    if ctx.params.get("save"):
        out["path"] = str(write_frames(frames, outputs_folder() / item.request_id))
    return msgspec.json.encode(out)


def outputs_folder() -> Path:
    """The folder this worker writes outputs into (``MCD_OUTPUTS``, created if need
    be). Raises ``ValueError`` (fails the request) when it is not configured."""
    raw = os.environ.get(OUTPUTS_ENV)
    if not raw:
        raise ValueError(f"this decode worker saves no files: {OUTPUTS_ENV} is not set")
    folder = Path(raw)
    folder.mkdir(parents=True, exist_ok=True)
    return folder

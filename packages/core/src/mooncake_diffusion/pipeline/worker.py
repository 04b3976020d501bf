"""A denoise worker with step checkpoints in a child process, driven by JSON lines: the
second process of the checkpoint tests, and a runnable example of resuming a job.

``python -m mooncake_diffusion.pipeline.worker`` reads settings from the
``MOONCAKE_*`` environment and speaks one JSON object per line:

    -> {"op": "denoise", "params": {GenerationParams fields}, "config": {...},
        "every": 2, "die_after": 5}
    <- {"ok": true, "resumed_from": 0, "saved": [2, 4], "steps_run": [1, ...],
        "latent_sha256": "...", "frames_sha256": "..."}
    -> {"op": "finish", "params": {...}, "config": {...}, "every": 2}
    <- {"ok": true, "removed": 2}
    -> {"op": "exit"}

``die_after: k`` makes the process SIGKILL itself right after step ``k`` (and
its checkpoint, when due) - a crash mid-job, with no reply. ``config`` holds
``PipelineConfig`` fields ({} for the defaults).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from typing import Any, TextIO

import torch

from mooncake_diffusion.caches.checkpoint import CheckpointCache
from mooncake_diffusion.pipeline.checkpointing import checkpoint_job_of, denoise_with_checkpoints
from mooncake_diffusion.pipeline.params import GenerationParams, PipelineConfig
from mooncake_diffusion.pipeline.reference import ReferencePipeline
from mooncake_diffusion.pipeline.sampler import SamplerState
from mooncake_diffusion.platform.childproc import JsonLinesChild, serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["DenoiseProcess", "digest"]


def digest(t: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _serve(settings: MooncakeSettings, stdin: TextIO, stdout: TextIO) -> int:
    pipes: dict[PipelineConfig, ReferencePipeline] = {}
    caches: dict[tuple[str, int], CheckpointCache] = {}

    def setup(cmd: dict) -> tuple[ReferencePipeline, CheckpointCache, GenerationParams]:
        config = PipelineConfig(**cmd.get("config", {}))
        pipe = pipes.get(config)
        if pipe is None:
            pipe = pipes[config] = ReferencePipeline(config)
        every = int(cmd.get("every", 1))
        cache = caches.get((pipe.model_id, every))
        if cache is None:
            cache = caches[(pipe.model_id, every)] = CheckpointCache(
                settings, model_id=pipe.model_id, sampler=pipe.sampler, every=every
            )
        return pipe, cache, GenerationParams(**cmd["params"])

    def denoise(cmd: dict) -> dict[str, Any]:
        pipe, cache, params = setup(cmd)
        die_after = cmd.get("die_after")
        ran: list[int] = []

        def on_step(k: int, state: SamplerState) -> None:
            ran.append(k)
            if die_after is not None and k == die_after:
                os.kill(os.getpid(), signal.SIGKILL)

        result = denoise_with_checkpoints(
            pipe, cache, pipe.condition(params), params, on_step=on_step
        )
        return {
            "ok": True,
            "resumed_from": result.resumed_from,
            "saved": list(result.saved),
            "steps_run": ran,
            "latent_sha256": digest(result.latent),
            "frames_sha256": digest(pipe.decode(result.latent)),
        }

    def finish(cmd: dict) -> dict[str, Any]:
        pipe, cache, params = setup(cmd)
        return {"ok": True, "removed": cache.finish(checkpoint_job_of(cache, pipe, params))}

    try:
        serve_json_lines({"denoise": denoise, "finish": finish}, stdin, stdout)
    finally:
        for c in caches.values():
            c.close()
    return 0


class DenoiseProcess(JsonLinesChild):
    """The worker in a child process (see the module docstring)."""

    def __init__(self, settings: MooncakeSettings) -> None:
        argv = [sys.executable, "-m", "mooncake_diffusion.pipeline.worker"]
        super().__init__(argv, settings, "denoise worker")


def main() -> int:
    return _serve(MooncakeSettings.from_env(), sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

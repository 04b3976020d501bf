"""Denoise with step checkpoints: the reference pipeline on top of ``CheckpointCache``.

    cache = CheckpointCache(settings, model_id=pipe.model_id, sampler=pipe.sampler, every=2)
    result = denoise_with_checkpoints(pipe, cache, cond, params)
    result.latent, result.resumed_from        # resumed_from: 0 when it started from noise
    ...                                       # publish result.latent, then
    cache.finish(result.job)                  # (or pass finish=True)

Any process that builds the same ``PipelineConfig`` resumes any other's job: the
checkpoint key is ``condition_key(params)`` plus seed, guidance, steps and
latent shape under the pipeline's model id and sampler name. A resumed run ends
in the same bytes as an uninterrupted one (``SamplerState`` is the whole state).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from mooncake_diffusion.caches.checkpoint import CheckpointCache, CheckpointJob
from mooncake_diffusion.caches.keys import canonical_json
from mooncake_diffusion.pipeline.params import GenerationParams
from mooncake_diffusion.pipeline.reference import ReferencePipeline
from mooncake_diffusion.pipeline.sampler import SamplerState

__all__ = ["CheckpointedDenoise", "checkpoint_job_of", "condition_key", "denoise_with_checkpoints"]


def condition_key(params: GenerationParams) -> str:
    """What conditions the trajectory besides seed/steps/guidance/shape: the prompt and,
    with CFG, the negative prompt (64 hex; the model id is in the checkpoint key)."""
    fields = {"negative": params.negative_prompt if params.cfg else None, "prompt": params.prompt}
    return hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()


def checkpoint_job_of(
    cache: CheckpointCache, pipe: ReferencePipeline, params: GenerationParams
) -> CheckpointJob:
    """The checkpoint job of ``params`` under ``pipe``'s weights."""
    return cache.job(
        cond_key=condition_key(params),
        seed=params.seed,
        guidance=float(params.guidance),
        steps=params.steps,
        shape=params.latent_shape(pipe.config),
    )


@dataclass(frozen=True)
class CheckpointedDenoise:
    """``latent``: the final latent; ``resumed_from``: the step it restarted at (0: from
    noise); ``saved``: the steps checkpointed by this call; ``job``: for ``finish``."""

    latent: torch.Tensor
    resumed_from: int
    saved: tuple[int, ...]
    job: CheckpointJob


def denoise_with_checkpoints(
    pipe: ReferencePipeline,
    cache: CheckpointCache,
    cond: Mapping[str, torch.Tensor],
    params: GenerationParams,
    *,
    finish: bool = False,
    on_step: Callable[[int, SamplerState], None] | None = None,
    should_stop: Callable[[int], bool] | None = None,
) -> CheckpointedDenoise:
    """Resume ``params``' job from its newest checkpoint (or start it), save a checkpoint
    at every due step, and return the final latent. ``on_step`` runs after each step,
    after that step's checkpoint is saved. ``should_stop`` preempts as in
    ``ReferencePipeline.denoise`` (``DenoisePreempted``; the checkpoints stay).
    ``finish``: remove the job's checkpoints before returning (only if nothing else
    must happen before the output is safe)."""
    job = checkpoint_job_of(cache, pipe, params)
    found = cache.latest(job)
    resume = None
    if found is not None:
        resume = SamplerState.from_tensors(found[1])
        if resume.step != found[0]:
            raise ValueError(f"checkpoint of step {found[0]} holds a state at {resume.step}")
    saved: list[int] = []

    def step_done(k: int, state: SamplerState) -> None:
        if cache.due(job, k) and cache.save(job, k, state.to_tensors()):
            saved.append(k)
        if on_step is not None:
            on_step(k, state)

    latent = pipe.denoise(cond, params, resume=resume, on_step=step_done, should_stop=should_stop)
    if finish:
        cache.finish(job)
    return CheckpointedDenoise(latent, 0 if resume is None else resume.step, tuple(saved), job)

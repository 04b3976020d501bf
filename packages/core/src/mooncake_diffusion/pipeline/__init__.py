"""A tiny but real diffusion pipeline in torch: Encode, Denoise, Decode on CPU.

Random weights from a seed, bitwise deterministic across processes; it measures
the serving system, not image quality. One concern per module:

    params.py        GenerationParams (a request), PipelineConfig (model sizes); no torch
    tokenizer.py     deterministic byte tokenisation
    runtime.py       deterministic(threads) context, seeded weight init
    layers.py        attention, MLP, sinusoidal positions
    text_encoder.py  Encode: transformer -> [1, L, D] per prompt
    dit.py           Denoise: DiT over patchified [B, C, T, H, W] latents
    sampler.py       flow-matching Euler sampler + CFG; SamplerState (serialisable)
    vae.py           Decode: causal-in-time decoder, chunk by chunk -> uint8 frames
    writers.py       PNG / GIF (Pillow)
    reference.py     ReferencePipeline: encode / condition / denoise / decode_chunks /
                     run_colocated
    checkpointing.py denoise_with_checkpoints: resume from / save to CheckpointCache
    worker.py        a JSON-lines denoise worker process with checkpoints (tests, example)

It knows nothing of the orchestrator: its stage functions for the worker runtime
live there (``mooncake_diffusion.orchestrator.worker.reference``). Call sequence:
see this package's ``reference.py``. Importing this package does not import
torch; the names below load their module (and torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SAMPLER_NAME",
    "CheckpointedDenoise",
    "DecodeStream",
    "DenoisePreempted",
    "GenerationParams",
    "ParamsError",
    "PipelineConfig",
    "ReferencePipeline",
    "SamplerState",
    "condition_key",
    "decode_params",
    "denoise_with_checkpoints",
    "encode_params",
    "write_frames",
]

_WHERE = {
    "SAMPLER_NAME": "sampler",
    "CheckpointedDenoise": "checkpointing",
    "condition_key": "checkpointing",
    "denoise_with_checkpoints": "checkpointing",
    "DecodeStream": "vae",
    "DenoisePreempted": "reference",
    "GenerationParams": "params",
    "ParamsError": "params",
    "PipelineConfig": "params",
    "ReferencePipeline": "reference",
    "SamplerState": "sampler",
    "decode_params": "params",
    "encode_params": "params",
    "write_frames": "writers",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

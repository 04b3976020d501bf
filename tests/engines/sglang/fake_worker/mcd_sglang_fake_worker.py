"""Test-only sglang plugin: the model worker faked, CUDA streams stood in for on CPU.

It is a distribution of its own (the ``.dist-info`` beside this file), found by
sglang's plugin discovery (``entry_points(group="sglang.multimodal_gen.plugins")``)
only in processes whose ``PYTHONPATH`` names this folder: the ``sglang serve``
processes that ``test_sglang_roles.py`` launches. sglang loads it the way it
loads the adapter, in every process (``load_plugins`` / ``apply_plugin_hooks``
in the CLI and in each spawned scheduler's ``worker_bootstrap``).

Replaced, and why (everything else is sglang's own: CLI, worker bootstrap,
``Scheduler`` with its disaggregation mixin and threads, ``DiffusionServer``,
the ``__transfer__`` protocol, the transfer buffer and manager):

- ``managers.cpu_worker.CPUWorker`` (the model worker the ``Scheduler`` builds
  on a CPU platform) -> ``FakeWorker``: the real one loads Wan 2.1's weights
  (gigabytes; no model hub here) and a forward pass takes minutes on CPU.
  ``FakeWorker`` keeps the contract the disaggregated ``Scheduler`` relies on
  (``local_rank``, ``metrics``, ``pipeline.get_module``, ``execute_forward``
  returning the ``Req`` for encoder/denoiser and an ``OutputBatch`` for the
  decoder) and produces tensors of the real shapes and dtypes.
- ``torch.get_device_module()`` called without a device -> ``torch.cpu``:
  sglang takes its transfer stream and events from it; sglang 0.5.23's torch
  is a CUDA build, which answers ``torch.cuda`` even with no GPU, and
  ``torch.cuda.Stream`` refuses ``cpu:0``. ``torch.cpu``'s Stream and Event are
  the synchronous equivalents (CPU copies finish before they return).

Observed, not replaced: around each ``DiffusionTransferManager.push_to_peer``
a hook records the result (not ok for a push that returned False or raised:
the adapter's hook raises after a failure; which of the two AROUND hooks wraps
the other follows plugin discovery, so this one sees either), the size pushed,
the adapter engine's counters by path and the request ids whose staging slots
the sender holds as the push ends (``staged``; sglang frees a pushed one only
after) in ``<request id>.<role>.push.json``.
An AFTER hook would not run when the push raises (sglang logs a warning for two
AROUND hooks on one target).

What the fake worker writes (``$MCD_FAKE_DIR``): ``<role>.pid`` at start-up;
per request ``<request id>.<role>.json`` with the SHA-256 of every tensor it
received and sent. A request whose prompt contains ``hold`` makes the denoiser
write ``<request id>.reached`` and wait for ``<request id>.released`` before it
returns (fault tests put their fault there). The prompt's first word sizes the
latents: ``mid`` is 32 MiB of float32 (with the text, a 64 MiB staging slot),
``medium`` is 44 MB of float32 (with the text embeddings the decoder gets too, it
still fits one of sglang's 64 MiB pre-allocated receive slots, and it is more
than loopback's socket buffers hold), ``large`` is 68 MB (``LATENTS``: Wan 2.1's
16 latent channels and 21 latent frames of an 81-frame video, 160x316 latent
pixels).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["FakeWorker", "register"]

DIR_ENV = "MCD_FAKE_DIR"
HOLD_MAX_S = 600.0

#: latents [batch, channels, latent frames, height/8, width/8] per size tag
LATENTS = {
    "small": [1, 16, 2, 8, 8],
    "mid": [1, 16, 16, 128, 256],  # 32 MiB: with the text, a 64 MiB staging slot
    "medium": [1, 16, 21, 160, 204],  # 44 MB: with the text, one 64 MiB pre-allocated slot
    "large": [1, 16, 21, 160, 316],
}
#: what a Wan text encoder hands the denoiser: name -> (dtype, shape)
TEXT = {
    "prompt_embeds": ("bfloat16", [1, 512, 4096]),
    "negative_prompt_embeds": ("bfloat16", [1, 512, 4096]),
    "prompt_attention_mask": ("int64", [1, 512]),
    "negative_attention_mask": ("int64", [1, 512]),
}


def digest(value: Any) -> Any:
    """SHA-256 of a tensor's bytes (a list of them for a list of tensors)."""
    import torch

    if isinstance(value, list | tuple):
        return [digest(v) for v in value]
    t = value.detach().to("cpu").contiguous()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def seed_of(request_id: str, name: str) -> int:
    """A deterministic seed per request and field (the test recomputes it)."""
    return int.from_bytes(hashlib.sha256(f"{request_id}/{name}".encode()).digest()[:4], "little")


def encoder_outputs(request_id: str, size: str) -> dict[str, Any]:
    """What the fake encoder produces for a request (the test builds the same)."""
    from mooncake_diffusion.handoff.demo import make_tensor

    out: dict[str, Any] = {
        name: [make_tensor(dtype, shape, seed_of(request_id, name))]
        for name, (dtype, shape) in TEXT.items()
    }
    out["latents"] = make_tensor("float32", LATENTS[size], seed_of(request_id, "latents"))
    return out


def denoised(latents: Any) -> Any:
    """The fake denoiser's output: a transform the test can recompute."""
    return latents * 0.5 + 1.0


class _Pipeline:
    pipeline_name = "WanPipeline"  # sglang checks for its GLM-Image special case

    def get_module(self, name: str) -> None:
        return None  # no diffusers scheduler: no per-request timesteps to set


class FakeWorker:
    """Stands in for sglang's ``CPUWorker`` (module docstring)."""

    def __init__(self, local_rank: int, rank: int, master_port: int, server_args: Any) -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.server_args = server_args
        self.metrics = None
        self.pipeline = _Pipeline()
        role = server_args.disagg_role
        self.role = getattr(role, "value", str(role))
        self.dir = Path(os.environ[DIR_ENV])
        (self.dir / f"{self.role}.pid").write_text(str(os.getpid()))

    def is_sleeping(self) -> bool:
        return False

    def execute_forward(self, reqs: list[Any], return_req: bool = False, **_: Any) -> Any:
        req = reqs[0]
        rid = req.request_id
        size = str(req.prompt).split()[0]
        record: dict[str, Any] = {"received": {}, "sent": {}}
        if self.role == "encoder":
            for name, value in encoder_outputs(rid, size).items():
                setattr(req, name, value)
                record["sent"][name] = digest(value)
        else:
            for name in (*TEXT, "latents"):
                value = getattr(req, name, None)
                if value is not None and (not isinstance(value, list) or value):
                    record["received"][name] = digest(value)
        if self.role == "denoiser":
            if "hold" in str(req.prompt):
                self._hold(rid)
            req.latents = denoised(req.latents)
            record["sent"]["latents"] = digest(req.latents)
        self._write(rid, record)
        if self.role != "decoder":
            return req
        import torch
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch

        # the decoder's "video": the digest of the latents it received, as bytes
        got = bytes.fromhex(record["received"]["latents"])
        return OutputBatch(output=torch.tensor(list(got), dtype=torch.uint8))

    def _write(self, rid: str, record: dict) -> None:
        tmp = self.dir / f".{rid}.{self.role}.json"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.dir / f"{rid}.{self.role}.json")

    def _hold(self, rid: str) -> None:
        (self.dir / f"{rid}.reached").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_MAX_S
        while not (self.dir / f"{rid}.released").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


class _CpuDeviceModule:
    """``torch.cpu``, except that ``Stream`` takes the arguments of ``torch.cuda.Stream``
    (sglang passes ``device=``); CPU work is synchronous, so one stream is all."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def Stream(device: Any = None, priority: int = 0, **_: Any) -> Any:
        import torch

        return torch.cpu.Stream()


_CPU = _CpuDeviceModule()


def cpu_device_module(original: Any, device: Any = None) -> Any:
    """``torch.get_device_module()`` with no device answers ``torch.cpu`` (docstring)."""
    return _CPU if device is None else original(device)


def record_push(original: Any, manager: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``push_to_peer``: what was pushed, and along which path (module docstring)."""
    from sglang.multimodal_gen.runtime.server_args import get_global_server_args

    rid = kwargs.get("request_id", args[0] if args else "")
    size = kwargs.get("transfer_size", args[3] if len(args) > 3 else 0)
    result, error = False, None
    try:
        result = original(manager, *args, **kwargs)
        return result
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        try:  # a record that cannot be written must not replace the push's own outcome
            role = get_global_server_args().disagg_role
            stats = getattr(manager._engine, "stats", None)
            with manager._lock:
                staged = sorted(manager._staged)
            record = {
                "ok": bool(result),
                "raised": error,
                "size": size,
                "by_path": stats().by_path if stats else {},
                "staged": staged,
            }
            path = Path(os.environ[DIR_ENV]) / f"{rid}.{getattr(role, 'value', role)}.push.json"
            path.write_text(json.dumps(record))
        except Exception as e:
            print(f"fake worker: push record of {rid} not written: {e!r}", flush=True)


def register() -> None:
    """Entry point (``sglang.multimodal_gen.plugins``): register both stand-ins."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType

    HookRegistry.register(
        "sglang.multimodal_gen.runtime.managers.cpu_worker.CPUWorker",
        FakeWorker,
        HookType.REPLACE,
    )
    HookRegistry.register("torch.get_device_module", cpu_device_module, HookType.AROUND)
    HookRegistry.register(
        "sglang.multimodal_gen.runtime.disaggregation.transport.manager."
        "DiffusionTransferManager.push_to_peer",
        record_push,
        HookType.AROUND,
    )

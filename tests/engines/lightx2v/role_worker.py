"""One LightX2V role in its own process, driven by JSON lines (test driver).

    python role_worker.py --model_cls wan2.1 --task i2v --config_json encoder.json

It does what ``python -m lightx2v.server`` does up to serving: ``import
lightx2v`` (which loads the installed ``lightx2v.platform_plugins``, i.e. the
adapter), ``set_config``, ``init_runner``; then runs one request per ``run``
line. Replies describe tensors by dtype, shape and SHA-256 (``describe``), so
the test compares every byte without moving tensors over the pipe.
Ops: ``run`` (seed), ``info``, ``release``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from typing import Any

import torch


def describe(obj: Any) -> Any:
    """A JSON-able description of nested dicts/lists of tensors, every byte hashed."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().reshape(-1).view(torch.uint8)
        return {
            "dtype": str(obj.dtype),
            "shape": list(obj.shape),
            "device": obj.device.type,
            "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest(),
        }
    if isinstance(obj, dict):
        return {k: describe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [describe(v) for v in obj]
    return obj


class InputInfo:
    """The part of LightX2V's per-request input info the roles read."""

    def __init__(self, seed: int, latent_shape: list[int] | None) -> None:
        self.seed = seed
        self.latent_shape = latent_shape
        self.auto_height = None
        self.auto_width = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model_cls", default="wan2.1")
    p.add_argument("--task", default="i2v")
    p.add_argument("--config_json", required=True)
    args = p.parse_args()

    import lightx2v  # noqa: F401  (loads the platform plugins, then the runners)
    from lightx2v.disagg import disagg_mixin
    from lightx2v.infer import init_runner
    from lightx2v.models.runners.wan.wan_runner import latent_dims
    from lightx2v.utils.set_config import set_config
    from lightx2v_platform import set_ai_device
    from mooncake_diffusion_lightx2v.plugin import patched

    from mooncake_diffusion.childproc import serve_json_lines

    config = set_config(args)
    runner = init_runner(config)

    def run(cmd: dict) -> dict:
        mode = config.get("disagg_mode")
        shape = list(latent_dims(config)) if mode == "encoder" else None
        out = runner.run_pipeline(InputInfo(int(cmd["seed"]), shape))
        reply = {"ok": True, "output": describe(out)}
        if mode in ("encoder", "transformer"):
            reply["inputs"] = describe(runner.inputs)
        if mode == "encoder":
            reply["latent_shape"] = shape
        if mode == "decode":
            reply["p2_meta"] = runner._p2_receive_meta
        return reply

    def info(cmd: dict) -> dict:
        state = getattr(runner, "_mcd", None)
        stats = state.connector.stats() if state is not None else None
        return {
            "ok": True,
            "patched": patched(disagg_mixin.DisaggMixin),
            "plugins": set_ai_device.LOADED_PLUGINS,
            "device_at_import": disagg_mixin.DEVICE_AT_IMPORT,
            "builtin_calls": runner.__dict__.get("builtin_calls", []),
            "p2_sender": repr(getattr(runner, "_disagg_p2_sender", None)),
            "adapter": state is not None,
            "settings": None
            if state is None
            else [state.cfg.settings.master, state.cfg.transfer_mode],
            "live_publications": None if stats is None else stats.live_publications,
            "pool_bytes_in_use": None if stats is None else stats.pool_bytes_in_use,
            "last_received": None if state is None else state.last_received,
            "queue": None
            if state is None or state.queue is None
            else {"alive": state.queue.alive, "error": str(state.queue.error or "")},
        }

    def release(cmd: dict) -> dict:
        runner.release_disagg()
        return {"ok": True, "builtin_calls": runner.__dict__.get("builtin_calls", [])}

    serve_json_lines({"run": run, "info": info, "release": release}, sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()

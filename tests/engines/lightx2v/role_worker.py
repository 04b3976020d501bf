"""One LightX2V role in its own process, driven by JSON lines (test driver).

    python role_worker.py --model_cls wan2.1 --task i2v --model_path DIR --config_json role.json

It runs LightX2V's own server worker (``lightx2v.server.services.inference.
worker.TorchrunInferenceWorker``): ``init(args)`` (``set_config``,
``init_runner``: ``init_modules`` -> ``init_disagg``, model loading) and, per
``run`` line, ``process_request(task_data)`` (input info, ``set_reuse``,
``set_config``, ``run_pipeline``). ``import lightx2v`` loads the installed
``lightx2v.platform_plugins``: the adapter and the test CPU platform. Only the
model loaders are replaced (``fakes.install``). Replies describe tensors by
dtype, shape and SHA-256, so the test compares every byte without moving
tensors over the pipe. Ops: ``run``, ``info``, ``release``. Exits 1 when the
worker's ``init`` fails (LightX2V logs why and returns False).

Only the runner module of ``--model_cls`` is imported (``lean_import``: the other
~40 runner modules that ``lightx2v.infer`` and ``lightx2v.pipeline`` name are
placeholders), which halves a role's start-up; set ``MCD_TEST_LX2V_FULL_IMPORT=1``
to import all of them as LightX2V does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from typing import Any

import torch


def describe(obj: Any) -> Any:
    from fakes import digest

    if isinstance(obj, torch.Tensor):
        return digest(obj)
    if isinstance(obj, dict):
        return {k: describe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [describe(v) for v in obj]
    return obj


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model_cls", default="wan2.1")
    p.add_argument("--task", default="i2v")
    p.add_argument("--model_path", required=True)
    p.add_argument("--config_json", required=True)
    args = p.parse_args()
    args.lora_dir = None
    args.warmup = False
    replies, sys.stdout = sys.stdout, sys.stderr  # LightX2V prints to stdout at import

    import fakes
    import lean_import

    if os.environ.get("MCD_TEST_LX2V_FULL_IMPORT") != "1":
        lean_import.install([lean_import.RUNNER_MODULES[args.model_cls]])
    import lightx2v
    from lightx2v.disagg import disagg_mixin
    from lightx2v.server.services.inference.worker import TorchrunInferenceWorker
    from lightx2v_platform.base import global_var
    from mooncake_diffusion_lightx2v import plugin

    fakes.install(args.model_cls)
    worker = TorchrunInferenceWorker()
    if not worker.init(args):
        sys.exit(1)
    from mooncake_diffusion.platform.childproc import (
        serve_json_lines,  # after init: see test_plugin
    )

    runner = worker.runner

    def run(cmd: dict) -> dict:
        fakes.SEEN.clear()
        task = {"task_id": f"t-{cmd['seed']}", "_return_pipeline_result": True, **cmd["task"]}
        out = asyncio.run(worker.process_request(task))
        reply = {"ok": True, "status": out["status"], "error": out.get("error")}
        reply["error_type"] = out.get("error_type")
        reply["seen"] = dict(fakes.SEEN)
        reply["output"] = describe(out.get("pipeline_return"))
        if runner.config.get("disagg_mode") == "encoder" and hasattr(runner, "inputs"):
            reply["inputs"] = describe(runner.inputs)
        meta = getattr(runner, "_p2_receive_meta", None)
        reply["p2_meta"] = meta
        return reply

    def info(cmd: dict) -> dict:
        state = getattr(runner, "_mcd", None)
        stats = state.connector.stats() if state is not None else None
        return {
            "ok": True,
            "lightx2v": lightx2v.__file__,
            "ai_device": global_var.AI_DEVICE,
            "platform": global_var.PLATFORM,
            "mixin_device": disagg_mixin.AI_DEVICE,  # bound when LightX2V imported the mixin
            "runner": type(runner).__name__,
            "config_locked": bool(getattr(runner.config, "_locked", False)),
            "patched": plugin.patched(disagg_mixin.DisaggMixin),
            "adapter": state is not None,
            "p2_sender": repr(getattr(runner, "_disagg_p2_sender", None)),
            "seen": dict(fakes.SEEN),  # queue mode: what the last item's fakes were given
            "live_publications": None if stats is None else stats.live_publications,
            "pool_bytes_in_use": None if stats is None else stats.pool_bytes_in_use,
            "last_received": None if state is None else state.last_received,
            "threads": sorted(t.name for t in threading.enumerate()),
            "queue": None
            if state is None or state.queue is None
            else {"alive": state.queue.alive, "error": str(state.queue.error or "")},
        }

    def release(cmd: dict) -> dict:
        if runner.config.get("disagg_mode"):  # LightX2V's own fails on a colocated runner
            runner.release_disagg()
        return {"ok": True}

    serve_json_lines({"run": run, "info": info, "release": release}, sys.stdin, replies)


if __name__ == "__main__":
    main()

"""An sglang role process for the adapter's tests, and what tests share with it.

``start_role`` brings sglang up the way a spawned scheduler does
(``worker_bootstrap``: ``load_plugins()``, ``apply_plugin_hooks()``), parses
``sglang serve`` arguments with sglang's own parser, sets the global server
args, and builds the transfer path with sglang's own classes: the engine from
``scheduler_mixin.create_transfer_engine`` (the binding the scheduler calls),
a ``TransferTensorBuffer`` and a ``DiffusionTransferManager``.

Run as a script it is the sender of the cross-process tests, driven by JSON
lines (``mooncake_diffusion.platform.childproc``): ``setup``, ``stage_push``, ``exit``.
Its protocol uses a private copy of stdout; fd 1 goes to stderr, so native
prints cannot corrupt it. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

#: the request's tensors: name -> list of (dtype, shape, seed); what sglang moves
#: between roles for a text-to-video request (list fields are lists in ``Req``)
FIELDS: dict[str, list[tuple[str, list[int], int]]] = {
    "prompt_embeds": [("bfloat16", [1, 512, 4096], 1)],
    "negative_prompt_embeds": [("bfloat16", [1, 512, 4096], 2)],
    "prompt_attention_mask": [("int64", [1, 512], 3)],
    "negative_attention_mask": [("int64", [1, 512], 4)],
    "latents": [("float32", [1, 16, 5, 60, 104], 5)],
}
POOL_BYTES = 64 << 20


def model_dir(root: str) -> str:
    """A local model folder that sglang's model resolver accepts (Wan 2.1 T2V)."""
    path = os.path.join(root, "Wan2.1-T2V-1.3B-Diffusers")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanPipeline", "_diffusers_version": "0.33.0"}, f)
    return path


def activate_plugins() -> None:
    """What sglang runs first in every process: discover plugins, apply hooks."""
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins

    load_plugins()
    apply_plugin_hooks()


def serve_args(model: str, role: str, *extra: str) -> Any:
    """``sglang serve`` arguments parsed by sglang's own parser, as ``_run_diffusion``
    does; sets them as the process's global server args."""
    import argparse

    from sglang.multimodal_gen.runtime.entrypoints.cli.serve import add_multimodal_gen_serve_args
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args

    argv = ["--model-path", model, "--disagg-role", role]
    argv += ["--disagg-server-addr", "tcp://127.0.0.1:5999", *extra]
    parser = argparse.ArgumentParser()
    add_multimodal_gen_serve_args(parser)
    ns, rest = parser.parse_known_args(argv)
    args = ServerArgs.from_cli_args(ns, rest, argv=argv)
    set_global_server_args(args)
    return args


@dataclass
class Role:
    """sglang's transfer path of one role process."""

    engine: Any
    buffer: Any
    manager: Any

    def close(self) -> None:
        self.manager.cleanup()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def start_role(model: str, role: str, *extra: str) -> Role:
    from sglang.multimodal_gen.runtime.disaggregation import scheduler_mixin
    from sglang.multimodal_gen.runtime.disaggregation.transport.buffer import (
        TransferTensorBuffer,
    )
    from sglang.multimodal_gen.runtime.disaggregation.transport.manager import (
        DiffusionTransferManager,
    )

    activate_plugins()
    args = serve_args(model, role, *extra)
    engine = scheduler_mixin.create_transfer_engine(
        hostname=args.disagg_p2p_hostname, gpu_id=0, ib_device=args.disagg_ib_device
    )
    device = "cuda:0" if engine.supports_gpu_direct else "cpu"
    buffer = TransferTensorBuffer(pool_size=POOL_BYTES, device=device, role_name=role)
    return Role(engine, buffer, DiffusionTransferManager(engine=engine, buffer=buffer))


def make_fields() -> dict[str, Any]:
    """The request's tensors, deterministic: every process builds the same bytes."""
    from mooncake_diffusion.handoff.demo import make_tensor

    return {
        name: [make_tensor(dtype, shape, seed) for dtype, shape, seed in specs]
        for name, specs in FIELDS.items()
    }


def make_req() -> Any:
    """A real sglang ``Req`` carrying the request's tensors."""
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

    fields = make_fields()
    fields["latents"] = fields["latents"][0]  # a tensor field, not a list
    params = SamplingParams(prompt="a red fox in snow", guidance_scale=5.0)
    return Req(sampling_params=params, **fields)


# --------------------------------------------------------------------------- child
def _main() -> int:
    from mooncake_diffusion.platform.childproc import serve_json_lines

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    state: dict[str, Any] = {}

    def setup(cmd: dict) -> dict:
        role = start_role(cmd["model"], "encoder", *cmd.get("extra", []))
        state["role"] = role
        return {"ok": True, "engine": type(role.engine).__name__, "session": role.engine.session_id}

    def stage_push(cmd: dict) -> dict:
        from mooncake_diffusion_sglang.failure import PushFailedError
        from sglang.multimodal_gen.runtime.disaggregation.scheduler_mixin import (
            extract_transfer_fields,
        )

        role: Role = state["role"]
        tensors, scalars = extract_transfer_fields(make_req())
        rid = cmd["request_id"]
        staged, event = role.manager.stage_tensors_async(rid, tensors, scalars)
        if event is not None:
            event.synchronize()
        size = staged.slot.size if cmd.get("whole_slot") else _payload_bytes(staged.manifest)
        try:  # the adapter's hook raises PushFailedError for a failed push
            ok = role.manager.push_to_peer(rid, cmd["session"], int(cmd["addr"]), size)
        except PushFailedError:
            ok = False
        if ok:
            role.manager.free_staged(rid)
        stats = role.engine.stats() if hasattr(role.engine, "stats") else None
        return {
            "ok": True,
            "pushed": ok,
            "manifest": staged.manifest,
            "fields": sorted(tensors),
            "size": size,
            "by_path": stats.by_path if stats else {},
            "error": str(getattr(role.engine, "last_error", "") or ""),
        }

    def close(cmd: dict) -> dict:
        role = state.pop("role", None)
        if role is not None:
            role.close()
        return {"ok": True}

    serve_json_lines({"setup": setup, "stage_push": stage_push, "close": close}, sys.stdin, proto)
    role = state.pop("role", None)
    if role is not None:
        role.close()
    return 0


def _payload_bytes(manifest: dict) -> int:
    """End of the last tensor in a staged slot (what has to move)."""
    import math

    import torch

    end = 0
    for entries in manifest.values():
        for e in entries:
            itemsize = torch.empty((), dtype=getattr(torch, e["dtype"])).element_size()
            end = max(end, e["offset"] + math.prod(e["shape"]) * itemsize)
    return end


if __name__ == "__main__":
    sys.exit(_main())

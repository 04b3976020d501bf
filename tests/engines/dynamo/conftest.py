"""Fixtures of the Dynamo end-to-end test (run by ``./dev engines dynamo``).

dynamo_stack   module: a Dynamo deployment of the MammothModa2 pipeline (AR ->
               DiT) on the session's real Mooncake cluster, as a user starts it:
               ``python -m dynamo.frontend``, ``python -m dynamo.vllm.omni
               --omni-router`` and two stage workers (``dyn_stage.py``: Dynamo's
               worker with only the model engine stubbed), discovery ``file``,
               request plane ``tcp``, event plane ``zmq`` (no etcd, no NATS). The
               0 -> 1 edge is MooncakeDiffusionConnector in store mode, named in
               the deploy YAML and nowhere else. A second router,
               ``router_reclaim``, serves the same stages as RECLAIM_MODEL_NAME
               (its own endpoint, ``--endpoint generate_reclaim``) with the
               adapter's opt-in hook on (``MOONCAKE_DIFFUSION_DYNAMO_RECLAIM=1``);
               the first router runs with it off, the default. Stopped
               (SIGTERM, then SIGKILL) at teardown.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from servicestack import Proc, free_port

HERE = Path(__file__).resolve().parent
MODEL_NAME = "mammoth-moda2-stub"
#: The model the reclaiming router serves (the same stage workers behind it).
RECLAIM_MODEL_NAME = "mammoth-moda2-stub-reclaim"
#: A bound on the deployment coming up, not a sleep: four processes import torch,
#: vLLM, vLLM-Omni and Dynamo (~9 GB of packages) at once, which took over 15 min
#: on a 2-core machine shared with other test runs (a few seconds of CPU each are
#: spent waiting on the disk).
START_TIMEOUT_S = 2400.0

#: The deploy YAML a user writes (docs/dynamo.md): vLLM-Omni's own schema; the
#: connector's settings come from the environment ($VAR is expanded by it).
DEPLOY_YAML = """\
async_chunk: false
pipeline: mammoth_moda2
connectors:
  mooncake:
    name: MooncakeDiffusionConnector
    extra:
      master: $MOONCAKE_MASTER
      admin: $MOONCAKE_ADMIN
      transfer_mode: store
stages:
  - stage_id: 0
    output_connectors:
      to_stage_1: mooncake
  - stage_id: 1
    input_connectors:
      from_stage_0: mooncake
"""
#: What vLLM-Omni reads to pick the pipeline (no weights: the engines are stubbed).
MODEL_CONFIG = '{"model_type": "mammoth_moda2", "architectures": ["Mammothmoda2Model"]}\n'


@dataclass
class DynamoStack:
    root: Path
    http_port: int
    gate: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def output(self, name: str) -> str:
        return "\n".join(self.procs[name].lines)


def _start(stack: DynamoStack, name: str, argv: list[str], env: dict[str, str]) -> None:
    stack.procs[name] = Proc(argv, env)


def _wait_models(stack: DynamoStack, names: set[str], deadline: float) -> None:
    import openai

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=10)
    try:
        while time.monotonic() < deadline:
            for name, proc in stack.procs.items():
                if proc.popen.poll() is not None:
                    raise AssertionError(
                        f"{name} exited ({proc.popen.returncode}):\n" + stack.output(name)[-6000:]
                    )
            try:
                if names <= {m.id for m in client.models.list()}:
                    return
            except openai.APIConnectionError:
                pass
            time.sleep(0.5)
    finally:
        client.close()
    tails = "\n".join(f"--- {n}\n{stack.output(n)[-3000:]}" for n in stack.procs)
    raise AssertionError(f"{sorted(names)} never all appeared on the frontend:\n{tails}")


@pytest.fixture(scope="module")
def dynamo_stack(mooncake_cluster) -> Iterator[DynamoStack]:
    s = mooncake_cluster.settings
    with tempfile.TemporaryDirectory(prefix="mcd-dynamo-") as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(MODEL_CONFIG)
        (root / "deploy.yaml").write_text(DEPLOY_YAML)
        (root / "kv").mkdir()
        (root / "gate").mkdir()
        stack = DynamoStack(root, free_port(), root / "gate")
        env = {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(root / "kv"),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_NAMESPACE": f"mcd{os.getpid()}",
            "MOONCAKE_MASTER": s.master,
            "MOONCAKE_ADMIN": s.admin_address,
            "HF_HUB_OFFLINE": "1",
            # PyPI's vLLM is a CUDA build: without a GPU its engine arguments fail
            # ("Failed to infer device type") unless told to take the CPU platform
            "VLLM_TARGET_DEVICE": "cpu",
            "PYTHONUNBUFFERED": "1",
        }
        omni = [
            "--model", str(root / "model"),
            "--stage-configs-path", str(root / "deploy.yaml"),
            "--output-modalities", "image",
        ]  # fmt: skip
        served = ["--served-model-name", MODEL_NAME]
        stage = [sys.executable, str(HERE / "dyn_stage.py"), *omni, *served]
        try:
            _start(stack, "stage0", [*stage, "--stage-id", "0"], env)
            _start(stack, "stage1", [*stage, "--stage-id", "1"],
                   {**env, "MCD_DYNAMO_GATE_DIR": str(stack.gate)})  # fmt: skip
            # the router as a user starts it: nothing of ours imported up front
            router = [sys.executable, "-m", "dynamo.vllm.omni", *omni, "--omni-router"]
            _start(stack, "router", [*router, *served], env)
            # the same with the adapter's reclaim hook on: its own endpoint and model
            # name, so the frontend sends it only the requests that name that model
            _start(stack, "router_reclaim",
                   [*router, "--served-model-name", RECLAIM_MODEL_NAME,
                    "--endpoint", "generate_reclaim"],
                   {**env, "MOONCAKE_DIFFUSION_DYNAMO_RECLAIM": "1"})  # fmt: skip
            _start(stack, "frontend", [sys.executable, "-m", "dynamo.frontend",
                                       "--http-port", str(stack.http_port)], env)  # fmt: skip
            _wait_models(stack, {MODEL_NAME, RECLAIM_MODEL_NAME},
                         time.monotonic() + START_TIMEOUT_S)  # fmt: skip
            yield stack
        finally:
            for proc in stack.procs.values():
                proc.terminate(timeout=30)

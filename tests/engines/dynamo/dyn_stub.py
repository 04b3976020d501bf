"""The model engines of the Dynamo test's stage workers: where vLLM would run.

A real vLLM stage worker cannot start on a CPU (PyPI's vLLM is a CUDA build:
``RuntimeError: Failed to infer device type``). Everything around the engine is
Dynamo's and vLLM-Omni's own: ``init_omni_stage`` and ``OmniStageWorker`` (request
parsing, sampling params, the connectors from the deploy YAML, MammothModa2's
``ar2diffusion`` processor between the stages, the write to the router). The
stubs below stand in for ``AsyncOmni`` of one stage and produce what the real
stage produces, in vLLM-Omni's own output types:

    ArStub   stage 0 (AR): an ``OmniRequestOutput`` whose single
             ``CompletionOutput`` carries token ids and
             ``multimodal_output["latent"]`` (one hidden row per prompt and
             generated token but the last, as ``ar2diffusion`` checks)
    DitStub  stage 1 (DiT): an ``OmniRequestOutput`` with one ``PIL`` image of
             the requested size, its colour a function of the hidden states
             it was given, so the test can tell they crossed the connector intact

The test computes the same functions (``prompt_ids``, ``latent``, ``colour``) to
know the image it must get. DitStub holds a request at a gate when the test arms
it (``GATE_DIR``): it writes ``held.json`` (its pid, the request id) and waits
until the test releases it or kills the worker, so a fault lands exactly there.
Armed with ``fail`` instead, it writes ``failed.json`` (the same) and raises, so
stage 1 answers the router with an error chunk (after it took the payload).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

GATE_DIR_ENV = "MCD_DYNAMO_GATE_DIR"
HIDDEN = 64
GENERATED = 5
HOLD_MAX_S = 300.0


def prompt_ids(text: str) -> list[int]:
    """The stub tokenizer: one id per UTF-8 byte (no vocabulary needed)."""
    return list(text.encode())


def latent(text: str) -> Any:
    """Stage 0's hidden states for ``text``: bf16, (len(prompt) + GENERATED - 1, HIDDEN)."""
    import torch

    n = len(prompt_ids(text)) + GENERATED - 1
    g = torch.Generator().manual_seed(sum(prompt_ids(text)) + 7)
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)


def colour(hidden: Any, token_ids: list[int]) -> tuple[int, int, int]:
    """The DiT stub's pixel colour: a digest of what it received."""
    h = hidden.float()
    return (
        int(h.abs().sum().item() * 1000) % 256,
        len(token_ids) % 256,
        sum(token_ids) % 256,
    )


class _Gate:
    def __init__(self) -> None:
        root = os.environ.get(GATE_DIR_ENV)
        self.root = Path(root) if root else None

    def _note(self, name: str, request_id: str) -> None:
        tmp = self.root / f"{name}.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "request_id": request_id}))
        tmp.rename(self.root / name)

    async def hold(self, request_id: str) -> None:
        if self.root is None:
            return
        if (self.root / "fail").exists():
            (self.root / "fail").unlink()  # one request per arming
            self._note("failed.json", request_id)
            raise RuntimeError("DitStub: failed as armed")
        if not (self.root / "armed").exists():
            return
        (self.root / "armed").unlink()  # one request per arming
        self._note("held.json", request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOLD_MAX_S
        while loop.time() < deadline and not (self.root / "released").exists():
            await asyncio.sleep(0.01)


class _Tokenizer:
    bos_token_id = 1


class _StubEngine:
    """What ``OmniStageWorker`` and Dynamo's health check call on ``AsyncOmni``."""

    def __init__(self, stage_id: int) -> None:
        self.stage_id = stage_id

    async def get_tokenizer(self) -> Any:
        return _Tokenizer()

    async def generate(self, prompt: Any, request_id: str, sampling_params_list: Any = None):
        yield await self.run(prompt, request_id)

    async def run(self, prompt: Any, request_id: str) -> Any:
        raise NotImplementedError


class ArStub(_StubEngine):
    async def run(self, prompt: Any, request_id: str) -> Any:
        from vllm.outputs import CompletionOutput
        from vllm_omni.outputs import OmniRequestOutput

        text = prompt["prompt"] if isinstance(prompt, dict) else str(prompt)
        ids = prompt_ids(text)
        generated = [(sum(ids) + i) % 1000 for i in range(GENERATED)]
        completion = CompletionOutput(
            index=0,
            text="",
            token_ids=generated,
            cumulative_logprob=None,
            logprobs=None,
            finish_reason="stop",
        )
        completion.multimodal_output = {"latent": latent(text)}
        return OmniRequestOutput(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            outputs=[completion],
            finished=True,
            stage_id=self.stage_id,
            final_output_type="latent",
        )


class DitStub(_StubEngine):
    def __init__(self, stage_id: int) -> None:
        super().__init__(stage_id)
        self.gate = _Gate()

    async def run(self, prompt: Any, request_id: str) -> Any:
        from PIL import Image
        from vllm_omni.outputs import OmniRequestOutput

        info = prompt["additional_information"]
        await self.gate.hold(request_id)
        rgb = colour(info["full_hidden_states"], list(info["full_token_ids"]))
        image = Image.new("RGB", (int(prompt["width"]), int(prompt["height"])), rgb)
        return OmniRequestOutput(
            request_id=request_id,
            finished=True,
            stage_id=self.stage_id,
            final_output_type="image",
            images=[image],
        )


def create_engine(model: str, stage_config: Any, stage_type: str, stage_id: int, *_: Any) -> Any:
    """Replaces ``dynamo.vllm.omni.stage_worker._create_engine`` (same parameters)."""
    return ArStub(stage_id) if stage_id == 0 else DitStub(stage_id)

"""The payload shapes vLLM-Omni sends through a connector, built from a seed, and a
digest that compares them across processes (structure plus every tensor byte).

Shapes follow the runtime (see shared/engines/vllm_omni.md, section 4):
``thinker2talker``: the Qwen3-Omni full payload, a nested dict of bf16 tensors,
token id lists and a bool ``finished`` tensor; ``chunk``: an async-chunk
``OmniPayloadStruct`` (real vLLM-Omni msgspec struct); ``kv``: packed KV-cache bytes
from vLLM-Omni's own ``KVCacheTransferData.to_bytes()``; ``diffusion``: a diffusion
stage payload dict of ``custom_output`` tensors; ``latent``: the bench's dict with
one bf16 latent of ``mb`` MiB; ``omni_output``: an ``OmniRequestOutput`` (what a
stage hands the next one) holding ``CompletionOutput``s with a ``multimodal_output``
set after construction, ``PIL`` images, a latent, a vLLM ``RequestOutput`` and a
``slice``; ``small`` / ``empty``: the plain dicts of vLLM-Omni's own connector tests.

The digest names the class of every vLLM / vLLM-Omni output object, image and
slice, so a payload that came back as dicts does not match what was sent.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np
import torch

__all__ = ["build", "digest", "expected_digest"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed)).to(torch.bfloat16)


def build(kind: str, seed: int, **kw: Any) -> Any:
    """The payload of ``kind`` for ``seed`` (deterministic, identical in every process)."""
    if kind == "thinker2talker":
        n = 96 + seed % 17
        ids = torch.randint(0, 151_000, (n + 40,), generator=_gen(seed)).tolist()
        return {
            "embed": {
                "prefill": _bf16((n, 2048), seed + 1),
                "tts_bos": _bf16((1, 2048), seed + 2),
                "tts_eos": _bf16((1, 2048), seed + 3),
                "tts_pad": _bf16((1, 2048), seed + 4),
            },
            "hidden_states": {"output": _bf16((n, 2048), seed + 5)},
            "ids": {"all": ids, "prompt": ids[:n]},
            "meta": {"finished": torch.tensor(True)},
            "speaker": "Ethan",
            "language": "Auto",
        }
    if kind == "chunk":
        from vllm_omni.data_entry_keys import CodesStruct, MetaStruct, OmniPayloadStruct

        chunk_id, last = kw["chunk_id"], kw["last"]
        codes = torch.randint(0, 2048, (16, 12), generator=_gen(seed + chunk_id))
        return OmniPayloadStruct(
            codes=CodesStruct(audio=codes),
            meta=MetaStruct(
                finished=torch.tensor(last),
                is_segment_finished=torch.tensor(last),
                chunk_seq=chunk_id,
                req_id=[f"req-{seed}"],
            ),
            hidden=_bf16((12, 1024), seed + 100 + chunk_id),
            request_id=f"req-{seed}",
        )
    if kind == "kv":
        from vllm_omni.distributed.omni_connectors.kv_transfer_manager import KVCacheTransferData

        layers = 4
        return KVCacheTransferData(
            request_id=f"req-{seed}",
            layer_blocks={
                "key_cache": [_bf16((64, 8, 128), seed + i) for i in range(layers)],
                "value_cache": [_bf16((64, 8, 128), seed + 50 + i) for i in range(layers)],
            },
            block_ids=list(range(4)),
            metadata={"seq_len": 64, "block_size": 16},
        ).to_bytes()
    if kind == "diffusion":
        return {
            "encoder_output": _bf16((1, 256, 4096), seed),
            "encoder_attention_mask": torch.ones((1, 256), dtype=torch.int64),
            "height": 720,
            "width": 1280,
        }
    if kind == "latent":
        numel = kw["mb"] * (1 << 20) // 2
        return {"latent": _bf16((1, 16, numel // (16 * 64 * 64), 64, 64), seed), "step": 0}
    if kind == "omni_output":
        return _omni_output(seed)
    if kind == "small":  # the dicts of vLLM-Omni's own connector tests
        return {"hello": "world", "n": seed, "values": list(range(seed, seed + 3))}
    if kind == "empty":
        return {}
    raise ValueError(f"unknown payload kind {kind!r}")


def _omni_output(seed: int) -> Any:
    from PIL import Image
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm_omni.outputs import OmniRequestOutput

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 151_000, 48).tolist()
    completion = CompletionOutput(
        index=0,
        text=f"a cat, seed {seed}",
        token_ids=ids[16:],
        cumulative_logprob=-1.5,
        logprobs=None,
        finish_reason="stop",
    )
    completion.multimodal_output = {"audio": _bf16((24_000,), seed + 1)}  # set afterwards
    raw = RequestOutput(f"req-{seed}", "a cat", ids[:16], None, [completion], True)
    images = [
        Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8), "RGB"),
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L"),
    ]
    return OmniRequestOutput(
        request_id=f"req-{seed}",
        prompt="a cat",
        prompt_token_ids=ids[:16],
        outputs=[completion],
        finished=True,
        stage_id=1,
        final_output_type="image",
        images=images,
        latents=_bf16((1, 16, 8, 12), seed + 2),
        _custom_output={"stage_output": raw, "window": slice(0, 16, 2)},
        stage_durations={"denoise": 1.25},
    )


def _class_of(o: Any) -> str | None:
    """``module.qualname`` of a vLLM / vLLM-Omni class instance, else None."""
    if type(o).__module__.split(".")[0] in ("vllm", "vllm_omni"):
        return f"{type(o).__module__}.{type(o).__qualname__}"
    return None


def _walk(o: Any, structs_as_dicts: bool) -> Any:
    if isinstance(o, torch.Tensor):
        t = o.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ["torch", str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    if isinstance(o, np.ndarray):
        return ["numpy", o.dtype.name, list(o.shape), hashlib.sha256(o.tobytes()).hexdigest()]
    if isinstance(o, bytes | bytearray | memoryview):
        return ["bytes", len(o), hashlib.sha256(bytes(o)).hexdigest()]
    if type(o).__module__.startswith("PIL.") or type(o).__name__ == "Image":
        from PIL import Image

        if isinstance(o, Image.Image):
            return ["PIL", o.mode, list(o.size), hashlib.sha256(o.tobytes()).hexdigest()]
    if isinstance(o, slice):
        return ["slice", o.start, o.stop, o.step]
    name = _class_of(o)
    if name is not None and name.endswith(("RequestOutput", "CompletionOutput")):
        return ["object", name, _walk(vars(o), structs_as_dicts)]
    if isinstance(o, msgspec.Struct):
        if not structs_as_dicts:
            raise TypeError("a struct came back as a struct")
        fields = {f: getattr(o, f) for f in o.__struct_fields__ if getattr(o, f) is not None}
        return _walk(fields, structs_as_dicts)
    if isinstance(o, dict):
        return {str(k): _walk(v, structs_as_dicts) for k, v in sorted(o.items(), key=str)}
    if isinstance(o, list | tuple):
        return [_walk(v, structs_as_dicts) for v in o]
    return o


def digest(received: Any) -> str:
    """The digest of what a ``get`` returned (structs must have become dicts)."""
    return hashlib.sha256(msgspec.json.encode(_walk(received, False))).hexdigest()


def expected_digest(sent: Any) -> str:
    """The digest a ``get`` of ``sent`` must have: structs as dicts of their set fields,
    tuples as lists, raw bytes as bytes of the same content."""
    return hashlib.sha256(msgspec.json.encode(_walk(sent, True))).hexdigest()

"""LightX2V's Phase 1 and Phase 2 dicts <-> named tensors plus a small meta.

Pure functions, no I/O. The field selection mirrors LightX2V's DisaggMixin at
f8aee98b (``send_encoder_outputs`` / ``receive_encoder_outputs``,
``send_transformer_outputs`` / ``receive_transformer_outputs``), so a runner
downstream gets the keys, shapes and dtypes it gets today. What differs is on
the wire: each tensor moves at its real shape (no fp32-sized, zero-padded
buffers) and its metadata rides in the handle, not in a 4 KiB buffer.

Phase 1 tensors: ``context`` (T5 ``context`` or Qwen ``prompt_embeds``),
``context_null`` (only with ``enable_cfg``), ``clip_encoder_out`` and
``vae_encoder_out`` (image-conditioned tasks). Meta: ``version``, ``task``,
``latent_shape``, ``image_info`` (JSON-safe, as LightX2V cleans it),
``zeros`` (image slots LightX2V would send as zeros) and ``crc32`` (optional).
Phase 2: tensor ``latents``; meta ``latents_shape``, ``latents_dtype``,
``auto_height``, ``auto_width`` (LightX2V's names) and ``crc32``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from mooncake_diffusion.errors import PayloadError

__all__ = [
    "IMAGE_TASKS",
    "check_phase1",
    "checksums",
    "pack_phase1",
    "pack_phase2",
    "phase2_meta",
    "unpack_phase1",
    "verify",
]

#: Tasks whose Phase 1 carries CLIP and VAE-encoder outputs (LightX2V's list).
IMAGE_TASKS = ("i2v", "flf2v", "animate", "s2v", "rs2v", "i2i")
_QWEN = ("qwen_image", "qwen2.5_vl")


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Detached, contiguous, and in ``dtype`` when it is a float tensor (LightX2V
    writes every float tensor as ``GET_DTYPE()``); no copy when already so."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def _json_safe_image_info(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """LightX2V's cleaning of Qwen's ``image_info``: tensors become lists and
    ``vae_image_list`` is dropped."""
    if not info:
        return None
    out: dict[str, Any] = {}
    for k, v in info.items():
        if k == "vae_image_list":
            continue
        if isinstance(v, torch.Tensor):
            out[k] = v.tolist()
        elif isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            out[k] = [t.tolist() for t in v]
        else:
            out[k] = v
    return out


def pack_phase1(
    config: Mapping[str, Any],
    inputs: Mapping[str, Any],
    latent_shape: list[int],
    dtype: torch.dtype | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The encoder's ``inputs`` (``run_input_encoder()``'s dict) as named tensors
    and meta. Raises ``PayloadError`` when there is no context tensor."""
    text = inputs["text_encoder_output"]
    image = inputs.get("image_encoder_output")
    context = text.get("context", text.get("prompt_embeds"))
    context_null = text.get("context_null", text.get("negative_prompt_embeds"))
    if not isinstance(context, torch.Tensor):
        raise PayloadError("text_encoder_output has no 'context' / 'prompt_embeds' tensor")
    clip = vae = None
    if isinstance(image, Mapping):
        clip, vae = image.get("clip_encoder_out"), image.get("vae_encoder_out")
    elif isinstance(image, list) and image:  # Qwen I2I: a list of dicts or tensors
        item = image[0]
        vae = item.get("image_latents", item) if isinstance(item, Mapping) else item
    task = config.get("task")
    tensors = {"context": _cast(context, dtype)}
    if config.get("enable_cfg", False) and context_null is not None:
        tensors["context_null"] = _cast(context_null, dtype)
    zeros: list[str] = []
    if task in IMAGE_TASKS:
        if config.get("use_image_encoder", True):
            if clip is not None:
                tensors["clip_encoder_out"] = _cast(clip, dtype)
            else:
                zeros.append("clip_encoder_out")
        if vae is not None:
            tensors["vae_encoder_out"] = _cast(vae, dtype)
        else:
            zeros.append("vae_encoder_out")
    meta = {
        "version": 1,
        "task": task,
        "latent_shape": [int(d) for d in latent_shape],
        "image_info": _json_safe_image_info(text.get("image_info")),
        "zeros": zeros,
    }
    return tensors, meta


def _zeros_for(name: str, config: Mapping[str, Any], dtype: torch.dtype, meta: Mapping) -> Any:
    """What LightX2V's receiver sees for an image slot its encoder left empty."""
    if name == "clip_encoder_out":
        return torch.zeros(int(config.get("clip_embed_dim", 1024)), dtype=dtype)
    z = int(config.get("vae_z_dim", 16))
    latent = meta["latent_shape"]
    if config.get("task") == "i2i":  # LightX2V keeps the whole padded buffer for i2i
        stride = config.get("vae_stride", (4, 8, 8))
        t = 1 + (int(config.get("target_video_length", 81)) - 1) // int(stride[0])
        h = math.ceil(int(config.get("target_height", 480)) / int(stride[1]))
        w = math.ceil(int(config.get("target_width", 832)) / int(stride[2]))
        return torch.zeros((z + 4, t, h, w), dtype=dtype)
    return torch.zeros((z + 4, *latent[1:4]), dtype=dtype)


_IMAGE_SLOTS = ("clip_encoder_out", "vae_encoder_out")


def check_phase1(tensors: Mapping[str, Any], meta: Any) -> None:
    """Raise ``PayloadError`` unless ``meta`` (from the wire) is a Phase 1 meta this
    build reads and ``tensors`` holds its context: version 1, ``latent_shape`` a
    list of 1..8 non-negative ints,
    ``zeros`` a list of image slot names, ``task`` text or null, ``image_info`` an
    object or null, ``crc32`` an object of integers."""

    def bad(why: str) -> PayloadError:
        return PayloadError(f"LightX2V Phase 1 payload: {why}")

    if not isinstance(meta, Mapping):
        raise bad(f"meta is a {type(meta).__name__}, not an object")
    if meta.get("version") != 1 or isinstance(meta.get("version"), bool):
        raise bad(f"meta version {meta.get('version')!r}; this build reads version 1")
    shape = meta.get("latent_shape")
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= 8
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise bad(f"latent_shape {shape!r} is not a list of 1..8 non-negative ints")
    zeros = meta.get("zeros", [])
    if not isinstance(zeros, list) or any(z not in _IMAGE_SLOTS for z in zeros):
        raise bad(f"zeros {zeros!r} names slots other than {list(_IMAGE_SLOTS)}")
    if not isinstance(meta.get("task"), str | None):
        raise bad(f"task {meta.get('task')!r} is not text")
    if not isinstance(meta.get("image_info"), Mapping | None):
        raise bad("image_info is not an object")
    crc = meta.get("crc32", {})
    if not isinstance(crc, Mapping) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in crc.values()
    ):
        raise bad("crc32 is not an object of integers")
    if not isinstance(tensors.get("context"), torch.Tensor):
        raise bad("no 'context' tensor")


def unpack_phase1(
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    dtype: torch.dtype,
    device: Any,
) -> dict[str, Any]:
    """The transformer's ``receive_encoder_outputs()`` dict from received
    tensors; each tensor is copied to ``device`` (the received views may be
    released afterwards). Raises ``PayloadError`` on a malformed payload
    (``check_phase1``)."""
    check_phase1(tensors, meta)
    task = meta.get("task") or config.get("task", "i2v")
    got = {k: v.to(device, copy=True) for k, v in tensors.items()}
    for name in meta.get("zeros", []):
        got[name] = _zeros_for(name, config, dtype, meta).to(device)
    context = got["context"]
    context_null = got.get("context_null") if config.get("enable_cfg", False) else None
    text: dict[str, Any] = {}
    if config.get("model_cls", "") in _QWEN:
        text["prompt_embeds"] = context
        if context_null is not None:
            text["negative_prompt_embeds"] = context_null
        if meta.get("image_info"):
            text["image_info"] = meta["image_info"]
    else:
        text["context"] = context
        text["context_null"] = context_null
    image: Any = None
    if task in IMAGE_TASKS:
        vae = got.get("vae_encoder_out")
        if task == "i2i":
            image = [{"image_latents": vae}]
        else:
            image = {"clip_encoder_out": got.get("clip_encoder_out"), "vae_encoder_out": vae}
    return {
        "text_encoder_output": text,
        "image_encoder_output": image,
        "latent_shape": list(meta["latent_shape"]),
    }


def pack_phase2(latents: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The latents as LightX2V sends them: detached, in ``GET_DTYPE()``, contiguous."""
    return _cast(latents, dtype)


def phase2_meta(latents: torch.Tensor, input_info: Any) -> dict[str, Any]:
    """LightX2V's Phase 2 metadata (the hash aside): shape, dtype and the pixel
    size the decoder needs for packed (Qwen) latents."""
    return {
        "version": 1,
        "latents_shape": list(latents.shape),
        "latents_dtype": str(latents.dtype),
        "auto_height": getattr(input_info, "auto_height", None),
        "auto_width": getattr(input_info, "auto_width", None),
    }


def _crc32(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (host tensors: no copy; device tensors: one
    copy to host)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy().data)


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """CRC-32 per tensor: the optional, cheap integrity check (LightX2V runs
    SHA-256 over an fp32 copy of every tensor, always)."""
    return {name: _crc32(t) for name, t in tensors.items()}


def verify(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, int]) -> None:
    """Raise ``ValueError`` (as LightX2V does on a hash mismatch) when a received
    tensor's CRC-32 differs from the sender's; ``PayloadError`` (a ``ValueError``)
    when ``expected`` is not an object of integers."""
    if not isinstance(expected, Mapping) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in expected.values()
    ):
        raise PayloadError("LightX2V payload: crc32 is not an object of integers")
    for name, want in expected.items():
        if name not in tensors:
            raise ValueError(f"Disagg: {name} missing from the received payload")
        if _crc32(tensors[name]) != want:
            raise ValueError(f"Disagg: {name} checksum mismatch")

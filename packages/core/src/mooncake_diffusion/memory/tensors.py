"""Tensors as (pointer, length, layout): the only view of tensors the transports get.

Accepts torch tensors on any device and numpy arrays. Bytes are addressed by
data pointer, so a CUDA tensor works wherever the Mooncake build can register
device memory; nothing here assumes host memory. torch is imported only when a
torch tensor is seen or a view must be made of a dtype numpy lacks (bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_diffusion.errors import DestinationMismatchError, PayloadError
from mooncake_diffusion.wire.schema import DTYPE_SIZES, TensorSpec

__all__ = ["Region", "check_destination", "describe", "empty_buffer", "view_of"]

_NUMPY_NAMES = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
}


@dataclass(frozen=True)
class Region:
    """A contiguous span of memory and the object that keeps it alive.

    ``device`` is ``"cpu"`` or e.g. ``"cuda:0"``; it is passed to registration.
    """

    ptr: int
    nbytes: int
    owner: Any
    device: str = "cpu"
    #: The whole allocation ``ptr`` lies in (a torch storage, a numpy base array).
    #: Registration covers this extent, so views of one allocation share it.
    base_ptr: int = 0
    base_nbytes: int = 0
    #: device memory: the CUDA event recorded on the tensor's current stream when
    #: it was described; bytes may be read (or overwritten) once it completed
    ready: Any = None

    @property
    def extent(self) -> tuple[int, int]:
        if self.base_nbytes:
            return self.base_ptr, self.base_nbytes
        return self.ptr, self.nbytes


def _is_torch(t: Any) -> bool:
    """By the class, not ``sys.modules``: another thread may be mid-way through
    importing torch, and its half-initialized module has no ``Tensor`` yet."""
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(t).__mro__)


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe(name: str, t: Any) -> tuple[TensorSpec, Region]:
    """Describe tensor ``t`` for a handle; raises ``PayloadError`` if it cannot travel.

    The tensor must be contiguous: a strided view would need a staging copy,
    which this package never makes behind the caller's back.
    """
    if _is_torch(t):
        dtype = _torch_dtype_name(t)
        shape = tuple(int(d) for d in t.shape)
        strides = tuple(int(s) for s in t.stride())
        contiguous = t.is_contiguous()
        ptr, nbytes = int(t.data_ptr()), t.numel() * t.element_size()
        device = str(t.device)
        storage = t.untyped_storage()
        base = (int(storage.data_ptr()), int(storage.nbytes()))
    elif isinstance(t, np.ndarray):
        dtype = t.dtype.name
        shape = tuple(int(d) for d in t.shape)
        itemsize = t.dtype.itemsize
        strides = tuple(int(s) // itemsize for s in t.strides)
        contiguous = t.flags.c_contiguous
        ptr, nbytes = int(t.ctypes.data), int(t.nbytes)
        device = "cpu"
        root = t
        while isinstance(root.base, np.ndarray):
            root = root.base
        base = (int(root.ctypes.data), int(root.nbytes)) if root.flags.c_contiguous else (0, 0)
    else:
        raise PayloadError(
            f"tensor {name!r} is a {type(t).__name__}; expected a torch.Tensor or numpy.ndarray"
        )
    if dtype not in DTYPE_SIZES:
        raise PayloadError(f"tensor {name!r} has unsupported dtype {dtype}")
    if not contiguous:
        raise PayloadError(
            f"tensor {name!r} is not contiguous (shape {shape}, strides {strides}); "
            "call .contiguous() first so no hidden staging copy is made"
        )
    ranges = ((0, nbytes),) if nbytes else ()
    try:
        spec = TensorSpec(name, dtype, shape, _contiguous_strides(shape), ranges)
    except ValueError as e:  # name too long and the like
        raise PayloadError(f"tensor {name!r}: {e}") from None
    ready = _record_ready(t) if device.startswith("cuda") else None
    return spec, Region(ptr, nbytes, t, device, *base, ready=ready)


def _record_ready(t: Any) -> Any:
    """A CUDA event on ``t``'s device's current stream: the work queued so far
    (the kernels producing ``t``) is done once it completes. Waiting for it never
    synchronizes the whole device."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def check_destination(spec: TensorSpec, dst: Any) -> Region:
    """Validate a caller-supplied destination for ``spec``; returns its region.

    Raises ``DestinationMismatchError`` on dtype, shape or size mismatch and
    ``PayloadError`` if ``dst`` is not a contiguous tensor.
    """
    dspec, region = describe(spec.name, dst)
    if dspec.dtype != spec.dtype:
        raise DestinationMismatchError(
            f"destination {spec.name!r} has dtype {dspec.dtype}, payload has {spec.dtype}"
        )
    if dspec.shape != spec.shape:
        if dspec.nbytes < spec.nbytes:
            raise DestinationMismatchError(
                f"destination {spec.name!r} holds {dspec.nbytes} bytes, payload needs "
                f"{spec.nbytes} (shape {spec.shape})"
            )
        raise DestinationMismatchError(
            f"destination {spec.name!r} has shape {dspec.shape}, payload has {spec.shape}"
        )
    return region


def empty_buffer(nbytes: int, device: str = "cpu") -> Any:
    """A uint8 buffer of ``nbytes`` (torch when available, else numpy)."""
    try:
        import torch
    except ImportError:
        if device != "cpu":
            raise PayloadError(f"a {device} buffer needs torch installed") from None
        return np.empty(nbytes, dtype=np.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def view_of(buffer: Any, offset: int, spec: TensorSpec) -> Any:
    """A tensor view of ``spec`` over ``buffer[offset:]``; no bytes are copied."""
    n = spec.nbytes
    if _is_torch(buffer):
        import torch

        dtype = getattr(torch, spec.dtype)
        return buffer[offset : offset + n].view(dtype).view(spec.shape)
    if spec.dtype not in _NUMPY_NAMES:
        raise PayloadError(f"dtype {spec.dtype} needs torch installed to be received")
    return buffer[offset : offset + n].view(_NUMPY_NAMES[spec.dtype]).reshape(spec.shape)


def narrow(t: Any, dim: int, start: int, length: int) -> Any:
    """The view ``t[..., start:start + length, ...]`` along ``dim``; no copy."""
    if _is_torch(t):
        return t.narrow(dim, start, length)
    index = [slice(None)] * t.ndim
    index[dim] = slice(start, start + length)
    return t[tuple(index)]

"""Device memory on the transfer paths: the choice of path and the staging plan.

Pure logic (no torch, no CUDA); ``staging`` applies it. Each region of a transfer
takes one path, reported with the transfer:

    host        host memory, registered and moved as it is (every CPU transfer)
    gpu-direct  device memory registered with a CUDA build of Mooncake and moved
                by an RDMA NIC that can reach GPU memory (GPUDirect RDMA)
    staged      device memory copied through a pinned host buffer: device to
                host before the bytes leave, host to device after they land

``choose_path`` picks; ``plan_staging`` lays the staged regions out in one
pinned buffer; ``describe_paths`` is the string transports append to their path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from mooncake_diffusion.errors import ConfigError

__all__ = [
    "GPU_PATHS",
    "STAGING_ALIGN",
    "choose_path",
    "describe_paths",
    "nic_reaches_gpu",
    "plan_staging",
]

DevicePath = Literal["host", "gpu-direct", "staged"]
#: what ``MooncakeSettings.gpu_path`` accepts
GPU_PATHS = ("auto", "gpu-direct", "staged")
#: staged regions start on page boundaries inside the pinned buffer
STAGING_ALIGN = 4096
#: present when the kernel can give an RDMA NIC GPU memory (nvidia-peermem, or
#: the older nv_peer_mem "memory peers" interface)
_PEER_MEMORY = ("/sys/module/nvidia_peermem", "/sys/kernel/mm/memory_peers/nv_mem")


def nic_reaches_gpu(protocol: str, *, roots: Sequence[str] = _PEER_MEMORY) -> bool:
    """Whether transfers over ``protocol`` can read and write GPU memory in place.

    Only RDMA can, and only with a peer-memory kernel module loaded; Mooncake
    uses TCP whatever ``protocol`` says when ``MC_FORCE_TCP`` is set.
    """
    if protocol != "rdma" or os.environ.get("MC_FORCE_TCP", "").lower() in ("1", "true"):
        return False
    return any(Path(p).exists() for p in roots)


def choose_path(device: str, *, cuda_build: bool, nic_gpu: bool, force: str = "auto") -> DevicePath:
    """The path of a region on ``device`` (``"cpu"``, ``"cuda:0"``).

    ``cuda_build``: the installed Mooncake links CUDA (``deployment.inspect_build``);
    ``nic_gpu``: ``nic_reaches_gpu``; ``force``: ``MooncakeSettings.gpu_path``.
    Raises ``ConfigError`` when ``force="gpu-direct"`` cannot be honoured.
    """
    if device == "cpu":
        return "host"
    if force not in GPU_PATHS:
        raise ConfigError(f"gpu_path must be one of {GPU_PATHS}, got {force!r}")
    if force == "staged":
        return "staged"
    direct = cuda_build and nic_gpu
    if force == "gpu-direct" and not cuda_build:
        raise ConfigError(
            f"gpu_path='gpu-direct' for {device} memory needs a CUDA build of Mooncake; "
            "the installed one links no CUDA runtime (install mooncake-diffusion[cuda13] "
            "or [cuda12] to match torch)"
        )
    return "gpu-direct" if direct or force == "gpu-direct" else "staged"


def plan_staging(sizes: Iterable[int], align: int = STAGING_ALIGN) -> tuple[list[int], int]:
    """Offsets of regions of ``sizes`` bytes in one pinned buffer, and its size.

    Each region starts on an ``align`` boundary; zero-byte regions take no room.
    """
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align}")
    offsets, end = [], 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"negative region size {n}")
        offsets.append(end)
        end += (n + align - 1) & ~(align - 1)
    return offsets, end


def describe_paths(paths: Iterable[DevicePath]) -> str:
    """``""`` when every region is host memory (CPU transfers keep their path
    string), else the device paths used, e.g. ``"staged"`` or ``"gpu-direct+host"``."""
    used = sorted(set(paths))
    return "" if used in ([], ["host"]) else "+".join(used)

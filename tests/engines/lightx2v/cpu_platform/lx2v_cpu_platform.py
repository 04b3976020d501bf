"""A CPU platform for LightX2V, registered through its own ``lightx2v.platform_plugins``
entry point (test only: LightX2V at f8aee98b has no CPU platform).

The folder holding this module is put on ``PYTHONPATH``; the ``.dist-info`` next
to it declares the entry point, so ``importlib.metadata`` (which LightX2V's
``set_ai_device`` asks) finds it like an installed plugin. With ``PLATFORM=cpu``
LightX2V then sets ``AI_DEVICE = "cpu"``.

What cannot run on CPU as it stands, and what this plugin stands in for:
LightX2V calls ``getattr(torch, AI_DEVICE).mem_get_info()``,
``memory_allocated()``, ``memory_reserved()`` and ``empty_cache()``
(``DefaultRunner.maybe_empty_cache``, after every encode and every run), which
``torch.cpu`` lacks; the plugin adds them to ``torch.cpu`` (reporting ample
free memory, so LightX2V never empties a cache). Nothing else is replaced.
"""

from __future__ import annotations

import torch

_FREE = 1 << 40


class CpuDevice:
    """LightX2V's device protocol (see lightx2v_platform/base/nvidia.py) for CPU."""

    name = "cpu"

    @staticmethod
    def init_device_env() -> None:
        pass

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device() -> str:
        return "cpu"

    @staticmethod
    def init_parallel_env() -> None:
        raise RuntimeError("the test CPU platform runs one process per role")


def _memory_stand_ins() -> None:
    stand_ins = {
        "mem_get_info": lambda *a: (_FREE, _FREE),
        "memory_allocated": lambda *a: 0,
        "memory_reserved": lambda *a: 0,
        "empty_cache": lambda: None,
    }
    for name, fn in stand_ins.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def register() -> None:
    """The entry point: register ``cpu`` in LightX2V's device registry (idempotent)."""
    from lightx2v_platform.registry_factory import PLATFORM_DEVICE_REGISTER

    if "cpu" not in PLATFORM_DEVICE_REGISTER:
        PLATFORM_DEVICE_REGISTER.register(CpuDevice, key="cpu")
    _memory_stand_ins()

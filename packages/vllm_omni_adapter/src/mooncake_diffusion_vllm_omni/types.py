"""vLLM's and vLLM-Omni's output classes, registered so they travel as themselves.

vLLM-Omni's own codec (``OmniSerializer`` in ``omni_connectors/utils/serialization.py``
at 0.30.0) carries tensors, numpy arrays, ``PIL.Image``, vLLM ``RequestOutput`` and
``CompletionOutput`` (with a ``multimodal_output`` attribute set after construction),
``OmniRequestOutput`` and ``slice``; other dataclasses and msgspec Structs become
dicts. Core carries tensors, arrays, images and slices itself; this module registers
the three output classes with ``mooncake_diffusion.wire.carried`` (their attributes are
their state, so dynamic ones such as ``multimodal_output`` travel too). Translation
only: the mechanism is core's.

``register_types()`` is idempotent and called by the plugin entry point and by every
connector's ``__init__``, so a sender and a receiver built either way agree.
"""

from __future__ import annotations

import threading

__all__ = ["CARRIED_CLASSES", "register_types"]

#: (module, class) of each class registered here, with its wire tag.
CARRIED_CLASSES = (
    ("vllm.outputs", "RequestOutput"),
    ("vllm.outputs", "CompletionOutput"),
    ("vllm_omni.outputs", "OmniRequestOutput"),
)
_lock = threading.Lock()
_done = False


def register_types() -> None:
    """Register ``CARRIED_CLASSES`` with core (imports vLLM and vLLM-Omni's outputs)."""
    global _done
    with _lock:
        if _done:
            return
        import importlib

        from mooncake_diffusion.wire.carried import register_type

        for module, name in CARRIED_CLASSES:
            cls = getattr(importlib.import_module(module), name)
            register_type(cls, tag=f"{module}.{name}")
        _done = True

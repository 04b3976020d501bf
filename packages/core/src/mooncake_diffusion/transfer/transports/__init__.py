"""Transport registry: name -> ``"module:Class"``, imported on first use.

Built-ins: ``p2p`` (Transfer Engine), ``store`` (Mooncake Store relay) and
``memory`` (an in-process fake for unit tests of the layers above). A
duplicate name raises; an unknown name raises listing the known ones.
"""

from __future__ import annotations

import importlib

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.transfer.transports.base import Transport

__all__ = ["Transport", "known_transports", "load_transport", "register_transport"]

_REGISTRY: dict[str, str] = {
    "p2p": "mooncake_diffusion.transfer.transports.p2p:P2PTransport",
    "store": "mooncake_diffusion.transfer.transports.store:StoreTransport",
    "memory": "mooncake_diffusion.transfer.transports.memory:MemoryTransport",
}


def register_transport(name: str, target: str) -> None:
    """Register ``target`` (``"module:Class"``) under ``name``; duplicates raise."""
    if name in _REGISTRY:
        raise ConfigError(f"transport {name!r} is already registered as {_REGISTRY[name]}")
    if ":" not in target:
        raise ConfigError(f"transport target must be 'module:Class', got {target!r}")
    _REGISTRY[name] = target


def known_transports() -> list[str]:
    return sorted(_REGISTRY)


def load_transport(name: str) -> type[Transport]:
    """The transport class registered under ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown transport {name!r}; known: {', '.join(known_transports())}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)

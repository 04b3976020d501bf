"""Which runners the adapter takes: stdlib only, so the plugin can decide even when
the rest of the adapter (or core, or Mooncake) failed to import."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BACKEND", "selects_adapter"]

#: The ``disagg_config.transfer_backend`` value that routes a runner through the adapter.
BACKEND = "mooncake_diffusion"


def selects_adapter(config: Mapping[str, Any] | None) -> bool:
    """Whether a runner ``config`` names this adapter (any other value: LightX2V's path)."""
    if not config:
        return False
    disagg = config.get("disagg_config") or {}
    return isinstance(disagg, Mapping) and disagg.get("transfer_backend") == BACKEND

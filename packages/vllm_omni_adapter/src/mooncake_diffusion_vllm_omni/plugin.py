"""The ``vllm.general_plugins`` entry point: register the connector's name and types.

vLLM loads every ``vllm.general_plugins`` entry point in each engine-core and
worker process (and during argument parsing), so the name resolves wherever a
connector is built. ``register()`` may run many times in one process: it
registers only when the name is not there yet. ``VLLM_PLUGINS`` (vLLM's
allow-list), when set, must include ``mooncake_diffusion``.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["CONNECTOR_NAME", "register"]

#: The name to use under ``connectors: {<logical>: {name: ...}}`` in a deploy YAML.
CONNECTOR_NAME = "MooncakeDiffusionConnector"
_lock = threading.Lock()


def _create(config: dict[str, Any]) -> Any:
    from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector

    return MooncakeDiffusionConnector(config)


def register() -> None:
    """Register ``CONNECTOR_NAME`` with ``OmniConnectorFactory``; idempotent, thread-safe.

    Imports vLLM-Omni's factory and the output classes that travel as themselves
    (``types.register_types``); the connector class loads on first use."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    with _lock:
        if CONNECTOR_NAME not in OmniConnectorFactory.list_registered_connectors():
            OmniConnectorFactory.register_connector(CONNECTOR_NAME, _create)
    from mooncake_diffusion_vllm_omni.types import register_types

    register_types()

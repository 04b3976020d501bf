"""The entry points that register the connector's name.

``vllm.general_plugins`` -> ``register``: vLLM loads these in each engine-core
and worker process (and during argument parsing).

``vllm_omni.platform_plugins`` -> ``probe_platform``: vLLM-Omni calls these the
first time a process asks for ``vllm_omni.platforms.current_omni_platform``,
which importing ``vllm_omni.distributed.omni_connectors`` does (its
shared-memory connector reads the platform), so it runs before any connector
can be built, also in processes that never parse vLLM's arguments (NVIDIA
Dynamo's ``python -m dynamo.vllm.omni --omni-router``). It registers and
declines to be a platform (returns ``None``).

``register()`` may run many times in one process: it registers only when the
name is not there yet. ``VLLM_PLUGINS`` (vLLM's allow-list, read for both
groups), when set, must include ``mooncake_diffusion``.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["CONNECTOR_NAME", "probe_platform", "register"]

#: The name to use under ``connectors: {<logical>: {name: ...}}`` in a deploy YAML.
CONNECTOR_NAME = "MooncakeDiffusionConnector"
_lock = threading.Lock()


def _create(config: dict[str, Any]) -> Any:
    from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector

    return MooncakeDiffusionConnector(config)


def register() -> None:
    """Register ``CONNECTOR_NAME`` with ``OmniConnectorFactory``; idempotent, thread-safe.

    Imports only vLLM-Omni's factory (the connector class loads on first use)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    with _lock:
        if CONNECTOR_NAME not in OmniConnectorFactory.list_registered_connectors():
            OmniConnectorFactory.register_connector(CONNECTOR_NAME, _create)


def probe_platform() -> None:
    """The ``vllm_omni.platform_plugins`` entry point: ``register()``, then ``None``
    ("not this platform"), so vLLM-Omni's own platform detection is unchanged.

    vLLM-Omni logs and swallows what a platform probe raises; ``register`` only
    raises when vLLM-Omni itself is broken, and then building any connector fails too."""
    register()

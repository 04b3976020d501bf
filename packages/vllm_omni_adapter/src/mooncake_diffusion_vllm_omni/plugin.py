"""The entry points that register the connector's name (and the types it carries).

``vllm.general_plugins`` -> ``register``: vLLM loads these in each engine-core
and worker process (and during argument parsing). It registers the name and the
output classes that travel as themselves (``types.register_types``).

``vllm_omni.platform_plugins`` -> ``probe_platform``: vLLM-Omni calls these the
first time a process asks for ``vllm_omni.platforms.current_omni_platform``,
which importing ``vllm_omni.distributed.omni_connectors`` does (its
shared-memory connector reads the platform), so it runs before any connector
can be built, also in processes that never parse vLLM's arguments (NVIDIA
Dynamo's ``python -m dynamo.vllm.omni --omni-router``). It registers the name
only (the connector registers the types when it is built: importing vLLM's
output classes in the middle of that import is not safe) and declines to be a
platform (returns ``None``).

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

    Imports vLLM-Omni's factory and the output classes that travel as themselves
    (``types.register_types``); the connector class loads on first use."""
    _register_name()
    from mooncake_diffusion_vllm_omni.types import register_types

    register_types()


def probe_platform() -> None:
    """The ``vllm_omni.platform_plugins`` entry point: register the name, then return
    ``None`` ("not this platform"), so vLLM-Omni's own platform detection is unchanged.

    vLLM-Omni logs and swallows what a platform probe raises; this only raises when
    vLLM-Omni itself is broken, and then building any connector fails too."""
    _register_name()


def _register_name() -> None:
    """Imports only vLLM-Omni's factory."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    with _lock:
        if CONNECTOR_NAME not in OmniConnectorFactory.list_registered_connectors():
            OmniConnectorFactory.register_connector(CONNECTOR_NAME, _create)

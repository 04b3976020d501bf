"""The entry points that register the connector's name (and the types it carries).

``vllm.general_plugins`` -> ``register``: vLLM loads these in each engine-core
and worker process (and during argument parsing). It registers the name and the
output classes that travel as themselves (``types.register_types``).

``vllm_omni.platform_plugins`` -> ``probe_platform``: vLLM-Omni calls these the
first time a process asks for ``vllm_omni.platforms.current_omni_platform``,
which importing ``vllm_omni.distributed.omni_connectors`` does (its
shared-memory connector reads the platform), so it runs before any connector
can be built, also in processes that never parse vLLM's arguments (NVIDIA
Dynamo's ``python -m dynamo.vllm.omni --omni-router``). It has the name
registered once vLLM-Omni's connector factory has loaded (an import hook; the
connector registers the types when it is built) and declines to be a platform
(returns ``None``).

Each connector it builds also installs, when ``MOONCAKE_DIFFUSION_DYNAMO_RECLAIM`` is
on and Dynamo's omni router is loaded, the router hook of ``dynamo.py``.

``register()`` may run many times in one process: it registers only when the
name is not there yet. ``VLLM_PLUGINS`` (vLLM's allow-list, read for both
groups), when set, must include ``mooncake_diffusion``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

__all__ = ["CONNECTOR_NAME", "probe_platform", "register"]

#: The name to use under ``connectors: {<logical>: {name: ...}}`` in a deploy YAML.
CONNECTOR_NAME = "MooncakeDiffusionConnector"
_lock = threading.Lock()


def _create(config: dict[str, Any]) -> Any:
    from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector
    from mooncake_diffusion_vllm_omni.dynamo import install_if_enabled

    connector = MooncakeDiffusionConnector(config)
    install_if_enabled()  # Dynamo's router: the opt-in reclaim hook (dynamo.py)
    return connector


def register() -> None:
    """Register ``CONNECTOR_NAME`` with ``OmniConnectorFactory``; idempotent, thread-safe.

    Imports vLLM-Omni's factory and the output classes that travel as themselves
    (``types.register_types``); the connector class loads on first use."""
    _register_name()
    from mooncake_diffusion_vllm_omni.types import register_types

    register_types()


def probe_platform() -> None:
    """The ``vllm_omni.platform_plugins`` entry point: have the name registered, then
    return ``None`` ("not this platform"), so vLLM-Omni's platform detection is unchanged.

    It imports nothing: the probe can run in the middle of vLLM-Omni's own imports,
    where importing the factory re-enters them (and vLLM-Omni swallows what a probe
    raises). If vLLM-Omni's connector factory is fully loaded it registers now;
    otherwise an import hook registers right after the factory module, or the module
    that builds connectors from a deploy YAML, finishes loading."""
    factory = sys.modules.get(_WATCHED[0])
    if factory is not None and hasattr(factory, "OmniConnectorFactory"):
        _register_name()
        return
    with _lock:
        if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport())


#: Modules after whose loading the factory is complete: the factory itself, and the
#: module that builds connectors from a deploy YAML (it imports the factory).
_WATCHED = (
    "vllm_omni.distributed.omni_connectors.factory",
    "vllm_omni.distributed.omni_connectors.utils.initialization",
)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a ``_WATCHED`` module so that, once it
    has run, the name is registered and this hook removes itself from ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader, self)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, inner: Any, hook: _RegisterAfterImport) -> None:
        self.inner, self.hook = inner, hook

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        factory = sys.modules.get(_WATCHED[0])
        if factory is None or not hasattr(factory, "OmniConnectorFactory"):
            return  # the factory is still loading; the next watched module will do
        with _lock:
            if self.hook in sys.meta_path:
                sys.meta_path.remove(self.hook)
        _register_name()


def _register_name() -> None:
    """Imports only vLLM-Omni's factory."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    with _lock:
        if CONNECTOR_NAME not in OmniConnectorFactory.list_registered_connectors():
            OmniConnectorFactory.register_connector(CONNECTOR_NAME, _create)

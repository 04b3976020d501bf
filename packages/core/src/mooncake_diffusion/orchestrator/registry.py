"""Routing-policy registry: name -> ``"module:Class"``, imported on first use.

Built-ins: ``round_robin``, ``least_loaded``, ``affinity``. Other packages add
policies through the entry-point group ``mooncake_diffusion.routing_policies``
(``name = "module:Class"``), read once, on the first lookup, without importing
anything; or in code with ``register_policy``. Strict: a name registered
twice (in code or by two entry points with different targets) raises, and an
unknown name raises listing the known ones. An entry point that repeats a
built-in with the same target (this package declares its own) is not a
duplicate.

    register_policy("mine", "my_pkg.routing:MyPolicy")   # optional
    policy = create_policy("affinity", keys=("node",))  # imports, constructs
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mooncake_diffusion.orchestrator.errors import OrchestratorConfigError
from mooncake_diffusion.orchestrator.policy import RoutingPolicy

__all__ = [
    "ENTRY_POINT_GROUP",
    "PolicyRegistry",
    "create_policy",
    "known_policies",
    "load_policy",
    "register_policy",
]

ENTRY_POINT_GROUP = "mooncake_diffusion.routing_policies"

BUILTIN_POLICIES: dict[str, str] = {
    "round_robin": "mooncake_diffusion.orchestrator.policies:RoundRobin",
    "least_loaded": "mooncake_diffusion.orchestrator.policies:LeastLoaded",
    "affinity": "mooncake_diffusion.orchestrator.policies:AffinityLeastLoaded",
}


def _installed_entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _check_target(name: str, target: str) -> None:
    if not isinstance(name, str) or not name:
        raise OrchestratorConfigError(f"a routing policy name must be a non-empty string: {name!r}")
    module, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not (module and sep and attr):
        raise OrchestratorConfigError(
            f"routing policy {name!r}: target must be 'module:Class', got {target!r}"
        )


class PolicyRegistry:
    """Names to policy classes. Not thread-safe: fill it before serving.

    ``entry_points`` returns the entry points to merge on first use (the
    installed ones by default; tests pass their own).
    """

    def __init__(
        self,
        builtins: Mapping[str, str] = BUILTIN_POLICIES,
        entry_points: Callable[[], Iterable[importlib.metadata.EntryPoint]] = (
            _installed_entry_points
        ),
    ) -> None:
        self._targets: dict[str, str] = {}
        for name, target in builtins.items():
            _check_target(name, target)
            self._targets[name] = target
        self._entry_points = entry_points
        self._discovered = False

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        for ep in self._entry_points():
            _check_target(ep.name, ep.value)
            known = self._targets.get(ep.name)
            if known is None:
                self._targets[ep.name] = ep.value
            elif known != ep.value:
                raise OrchestratorConfigError(
                    f"routing policy {ep.name!r} is registered twice: {known} and "
                    f"{ep.value} (entry point group {ENTRY_POINT_GROUP!r})"
                )

    def register(self, name: str, target: str) -> None:
        """Register ``target`` (``"module:Class"``) as ``name``; a known name raises."""
        _check_target(name, target)
        self._discover()
        if name in self._targets:
            raise OrchestratorConfigError(
                f"routing policy {name!r} is already registered as {self._targets[name]}"
            )
        self._targets[name] = target

    def known(self) -> list[str]:
        """Every registered name, sorted (reads entry points on the first call)."""
        self._discover()
        return sorted(self._targets)

    def load(self, name: str) -> type[RoutingPolicy]:
        """The class registered as ``name``, imported now. Raises ``OrchestratorConfigError``."""
        self._discover()
        target = self._targets.get(name)
        if target is None:
            raise OrchestratorConfigError(
                f"unknown routing policy {name!r}; known: {', '.join(self.known())}"
            )
        module, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise OrchestratorConfigError(
                f"routing policy {name!r}: cannot import {target}: {e}"
            ) from e
        if not (isinstance(cls, type) and callable(getattr(cls, "choose", None))):
            raise OrchestratorConfigError(
                f"routing policy {name!r}: {target} is not a class with a choose() method"
            )
        return cls

    def create(self, name: str, **options: Any) -> RoutingPolicy:
        """A new instance of policy ``name`` built with exactly ``options`` (none dropped)."""
        cls = self.load(name)
        try:
            return cls(**options)
        except TypeError as e:
            raise OrchestratorConfigError(
                f"routing policy {name!r} rejects options {sorted(options)}: {e}"
            ) from e


#: The process-wide registry the functions below use.
default_registry = PolicyRegistry()


def register_policy(name: str, target: str) -> None:
    """Add a policy to the process-wide registry; see ``PolicyRegistry.register``."""
    default_registry.register(name, target)


def known_policies() -> list[str]:
    return default_registry.known()


def load_policy(name: str) -> type[RoutingPolicy]:
    return default_registry.load(name)


def create_policy(name: str, **options: Any) -> RoutingPolicy:
    return default_registry.create(name, **options)

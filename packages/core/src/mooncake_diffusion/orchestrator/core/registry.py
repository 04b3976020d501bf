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
from typing import Any, Generic, TypeVar

from mooncake_diffusion.orchestrator.core.routing import RoutingPolicy
from mooncake_diffusion.orchestrator.errors import OrchestratorConfigError

__all__ = [
    "ENTRY_POINT_GROUP",
    "NamedRegistry",
    "PolicyRegistry",
    "create_policy",
    "known_policies",
    "load_policy",
    "register_policy",
]

ENTRY_POINT_GROUP = "mooncake_diffusion.routing_policies"
T = TypeVar("T")

BUILTIN_POLICIES: dict[str, str] = {
    "round_robin": "mooncake_diffusion.orchestrator.core.policies:RoundRobin",
    "least_loaded": "mooncake_diffusion.orchestrator.core.policies:LeastLoaded",
    "affinity": "mooncake_diffusion.orchestrator.core.policies:AffinityLeastLoaded",
}


def _installed(group: str) -> Callable[[], Iterable[importlib.metadata.EntryPoint]]:
    return lambda: importlib.metadata.entry_points(group=group)


class NamedRegistry(Generic[T]):
    """Names to classes with a required method, imported on first use; the shape
    every registry of this package shares (routing policies here, planners in
    ``elastic/planners.py``). ``kind`` names the thing in errors; ``method``: the method a
    registered class must have; ``group``: the entry-point group read on first
    use (``entry_points`` overrides the reader; tests pass their own). Not
    thread-safe: fill it before serving."""

    def __init__(
        self,
        kind: str,
        method: str,
        group: str,
        builtins: Mapping[str, str],
        entry_points: Callable[[], Iterable[importlib.metadata.EntryPoint]] | None = None,
    ) -> None:
        self._kind, self._method, self._group = kind, method, group
        self._targets: dict[str, str] = {}
        for name, target in builtins.items():
            self._check_target(name, target)
            self._targets[name] = target
        self._entry_points = entry_points or _installed(group)
        self._discovered = False

    def _check_target(self, name: str, target: str) -> None:
        if not isinstance(name, str) or not name:
            raise OrchestratorConfigError(
                f"a {self._kind} name must be a non-empty string: {name!r}"
            )
        module, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
        if not (module and sep and attr):
            raise OrchestratorConfigError(
                f"{self._kind} {name!r}: target must be 'module:Class', got {target!r}"
            )

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        for ep in self._entry_points():
            self._check_target(ep.name, ep.value)
            known = self._targets.get(ep.name)
            if known is None:
                self._targets[ep.name] = ep.value
            elif known != ep.value:
                raise OrchestratorConfigError(
                    f"{self._kind} {ep.name!r} is registered twice: {known} and "
                    f"{ep.value} (entry point group {self._group!r})"
                )

    def register(self, name: str, target: str) -> None:
        """Register ``target`` (``"module:Class"``) as ``name``; a known name raises."""
        self._check_target(name, target)
        self._discover()
        if name in self._targets:
            raise OrchestratorConfigError(
                f"{self._kind} {name!r} is already registered as {self._targets[name]}"
            )
        self._targets[name] = target

    def known(self) -> list[str]:
        """Every registered name, sorted (reads entry points on the first call)."""
        self._discover()
        return sorted(self._targets)

    def load(self, name: str) -> type[T]:
        """The class registered as ``name``, imported now. Raises ``OrchestratorConfigError``."""
        self._discover()
        target = self._targets.get(name)
        if target is None:
            raise OrchestratorConfigError(
                f"unknown {self._kind} {name!r}; known: {', '.join(self.known())}"
            )
        module, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise OrchestratorConfigError(
                f"{self._kind} {name!r}: cannot import {target}: {e}"
            ) from e
        if not (isinstance(cls, type) and callable(getattr(cls, self._method, None))):
            raise OrchestratorConfigError(
                f"{self._kind} {name!r}: {target} is not a class with a {self._method}() method"
            )
        return cls

    def create(self, name: str, **options: Any) -> T:
        """A new instance of ``name`` built with exactly ``options`` (none dropped)."""
        cls = self.load(name)
        try:
            return cls(**options)
        except TypeError as e:
            raise OrchestratorConfigError(
                f"{self._kind} {name!r} rejects options {sorted(options)}: {e}"
            ) from e


class PolicyRegistry(NamedRegistry[RoutingPolicy]):
    """Routing-policy names to classes with a ``choose`` method (the module docstring)."""

    def __init__(
        self,
        builtins: Mapping[str, str] = BUILTIN_POLICIES,
        entry_points: Callable[[], Iterable[importlib.metadata.EntryPoint]] | None = None,
    ) -> None:
        super().__init__("routing policy", "choose", ENTRY_POINT_GROUP, builtins, entry_points)


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

"""Errors the orchestrator raises; part of the package's one tree.

Bad *events* (an unknown stage, a duplicate request id, a result for an item a
worker does not hold, a stale attempt) are never raised: the core answers them
with a ``Rejected`` action and carries on. These exceptions are for the code
that builds and drives the core:

    MooncakeDiffusionError
    └── OrchestratorError
        ├── OrchestratorConfigError (ConfigError, ValueError)
        │                          bad OrchestratorConfig / SloClass values, an
        │                          unknown or duplicate routing policy name, a
        │                          policy target that does not import or construct
        ├── PolicyContractError    a routing policy broke its contract (raised, or
        │                          returned a worker that is not a candidate)
        └── ClockError (ValueError) time passed to the core went backwards

None is retryable: each is a programming or configuration error.
"""

from __future__ import annotations

from typing import Any

from mooncake_diffusion.errors import ConfigError, MooncakeDiffusionError

__all__ = ["ClockError", "OrchestratorConfigError", "OrchestratorError", "PolicyContractError"]


class OrchestratorError(MooncakeDiffusionError):
    """Base of every error raised by ``mooncake_diffusion.orchestrator``."""


class OrchestratorConfigError(OrchestratorError, ConfigError, ValueError):
    """The orchestrator's configuration or its routing-policy registry is unusable."""


class PolicyContractError(OrchestratorError):
    """A routing policy raised or chose a worker outside its candidates.

    The core's state stays consistent (the item is back in its queue), but the
    actions produced earlier in the same ``handle`` call were not returned; they
    are in ``actions`` and the driver must still execute them.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.actions: list[Any] = []


class ClockError(OrchestratorError, ValueError):
    """``now`` went backwards: the core only accepts non-decreasing time."""

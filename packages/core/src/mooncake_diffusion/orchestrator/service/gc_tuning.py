"""Process settings for the standalone orchestrator: shorter collector pauses.

    settle_after_startup()      # once, after the service and its API are up

The standalone command (``mooncake-diffusion orchestrator``) owns its process,
so it may change an interpreter-wide setting that a library embedded in an
engine must not (``OrchestratorService`` never calls this): ``gc.freeze()``
moves the objects made while starting (the web stack, the models, the
recovered journal's state) to the collector's permanent generation. A full
collection then walks only what the service made since, not every object of
every module imported: its pause, which lands on whichever request the driver
or the HTTP thread is serving, shrinks with it (``docs/performance.md``: the
service's slowest round trip). The collector's amortised work is unchanged.
"""

from __future__ import annotations

import gc

__all__ = ["settle_after_startup"]


def settle_after_startup() -> None:
    """Collect startup's garbage, then freeze what is left out of the collector's
    view (module docstring). Call once, after startup."""
    gc.collect()  # nothing unreachable is frozen
    gc.freeze()

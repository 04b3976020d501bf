"""Process settings for the standalone orchestrator: a short tail on the submit path.

    settle_after_startup()      # once, after the service and its API are up

The standalone command (``mooncake-diffusion orchestrator``) owns its process,
so it may change two interpreter-wide settings that a library embedded in an
engine must not (``OrchestratorService`` never calls this):

- ``gc.freeze()``: the objects made while starting (the web stack, the models,
  the recovered journal's state) move to the collector's permanent generation.
  A full collection then walks only what the service made since, not every
  object of every module imported: its pause, which lands on whichever request
  the driver or the HTTP thread is serving, shrinks with it.
- ``sys.setswitchinterval(SWITCH_INTERVAL_S)``: the driver thread (journal,
  core, ZeroMQ) and the HTTP thread share one interpreter lock. A thread that
  wants it waits until the holder blocks or the switch interval (5 ms by
  default) passes; a submission whose turn comes while the HTTP thread parses
  other requests waited up to that long. A shorter interval bounds that wait,
  at the cost of more lock hand-offs under load.
"""

from __future__ import annotations

import gc
import sys

__all__ = ["SWITCH_INTERVAL_S", "settle_after_startup"]

#: the interpreter lock's switch interval in the standalone service (default 5 ms)
SWITCH_INTERVAL_S = 0.0005


def settle_after_startup() -> None:
    """Freeze what startup made out of the collector's view and shorten the lock's
    switch interval (module docstring). Idempotent; call after startup only."""
    gc.collect()  # startup's garbage goes first: nothing unreachable is frozen
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)

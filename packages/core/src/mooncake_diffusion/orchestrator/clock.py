"""Where the orchestrator core gets time from: an injected clock, never the wall.

    clock = VirtualClock()            # tests and the simulator
    core = Orchestrator(config, clock=clock)
    clock.advance(2.5)                # time moves only when the driver says so
    core.handle(Tick())               # the core reads clock.now() once per call

A service passes ``MonotonicClock()`` instead. Either way the core calls
``now()`` exactly once per ``handle`` call (and not at all when the caller
passes ``now=`` explicitly), so a run is reproducible from its event log.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from mooncake_diffusion.orchestrator.errors import ClockError

__all__ = ["Clock", "MonotonicClock", "VirtualClock"]


@runtime_checkable
class Clock(Protocol):
    """A source of time in seconds.

    Obligations: ``now()`` never decreases, does not block and has no side
    effects; its origin is arbitrary (only differences are used).
    """

    def now(self) -> float: ...


class MonotonicClock:
    """``time.monotonic()``: for a service running the core in real time."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Time that moves only when told to. Not thread-safe (nor needs to be)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
        if seconds < 0:
            raise ClockError(f"a virtual clock cannot go back ({seconds} s)")
        self._now += seconds
        return self._now

    def set(self, t: float) -> float:
        """Jump to ``t``, which must not be earlier than now; returns ``t``."""
        if t < self._now:
            raise ClockError(f"a virtual clock cannot go back from {self._now} to {t}")
        self._now = float(t)
        return self._now

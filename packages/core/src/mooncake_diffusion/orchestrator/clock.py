"""Where the orchestrator core gets time from: an injected clock, never the wall.

    clock = VirtualClock()            # tests and the simulator
    core = Orchestrator(config, clock=clock)
    clock.advance(2.5)                # time moves only when the driver says so
    core.handle(Tick())               # the core reads clock.now() once per call

A service passes ``MonotonicClock()`` instead (``OrchestratorService`` by default
a ``StallClock``: monotonic time less its driver's own stalls). Either way the core calls
``now()`` exactly once per ``handle`` call (and not at all when the caller
passes ``now=`` explicitly), so a run is reproducible from its event log.
"""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable

from mooncake_diffusion.orchestrator.errors import ClockError

__all__ = ["Clock", "MonotonicClock", "StallClock", "VirtualClock"]


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


class StallClock:
    """``time.monotonic()`` less the time its driver could not run, for a service.

    A driver that stalls (its process stopped, a turn blocked for seconds, the
    interpreter lock held elsewhere) finds frames queued that its workers sent
    while it could not read them; the core applies expiry before each event, so
    at the first of them every worker whose frames come later would be judged
    silent. ``stalled(seconds)`` takes such a stall out of the time: ``now()`` is
    ``time.monotonic()`` less every stall reported so far, and never decreases (a
    report larger than the time since the last ``now()`` only holds time level).
    Deadlines of requests are in the same time, so a stall does not count against
    them either. ``now()`` and ``stalled()`` belong to one thread (the driver's).
    """

    def __init__(self) -> None:
        #: seconds taken out so far
        self.taken = 0.0
        self._last = -math.inf

    def now(self) -> float:
        t = time.monotonic() - self.taken
        if t < self._last:
            t = self._last
        self._last = t
        return t

    def stalled(self, seconds: float) -> None:
        """Take ``seconds`` (> 0; a smaller value is ignored) out of the time."""
        if seconds > 0:
            self.taken += seconds


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

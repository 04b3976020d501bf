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
from collections.abc import Callable
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


class _Freezes(Protocol):
    """What a ``StallClock`` reads of a ``stalls.StallWatch``."""

    def frozen(self) -> float: ...


class StallClock:
    """``time.monotonic()`` less the time its driver could not run, for a service.

    A driver that stalls (its process stopped, a turn blocked for seconds, the
    interpreter lock held elsewhere) finds frames queued that its workers sent
    while it could not read them; the core applies expiry before each event, so
    at the first of them every worker whose frames come later would be judged
    silent. ``now()`` is ``time.monotonic()`` (``source``) less every stall reported with
    ``stalled(seconds)`` (a turn that ran long) and less every freeze of the
    process the attached ``StallWatch`` saw (``attach``), read at each call, so
    the first reading after a freeze already leaves it out. It never decreases (a
    stall larger than the time since the last ``now()`` only holds time level).
    Deadlines of requests are in the same time, so a stall does not count against
    them either. ``now()``, ``stalled()``, ``attach()`` and ``detach()`` belong to
    one thread (the driver's).
    """

    def __init__(self, source: Callable[[], float] = time.monotonic) -> None:
        """``source``: the monotonic time read (tests pass one that jumps, and
        give the watch the same)."""
        self.source = source
        #: seconds taken out so far (stalls reported, and freezes of a detached watch)
        self.taken = 0.0
        self._last = -math.inf
        self._watch: _Freezes | None = None

    def attach(self, watch: _Freezes) -> None:
        """Take ``watch.frozen()`` out of every reading from now on (one watch at a time)."""
        if self._watch is not None:
            raise ClockError("a stall clock watches one StallWatch at a time")
        self.taken -= watch.frozen()  # only what it notices from now on counts
        self._watch = watch

    def detach(self) -> None:
        """Stop reading the watch; what it counted stays taken out."""
        if self._watch is not None:
            self.taken += self._watch.frozen()
            self._watch = None

    def stalls_s(self) -> float:
        """Seconds taken out so far: the stalls reported and the freezes watched."""
        return self.taken + (0.0 if self._watch is None else self._watch.frozen())

    def now(self) -> float:
        frozen = 0.0 if self._watch is None else self._watch.frozen()
        t = self.source() - self.taken - frozen
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

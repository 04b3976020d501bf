"""The virtual-time event loop both simulators share.

    events = EventQueue(clock)
    events.at(0.0, "submit", 0)           # schedule: (time, kind, argument)
    events.run({"submit": on_submit})     # pop in time order, set the clock, dispatch

Events at the same virtual time run in the order they were scheduled, so a run
is deterministic for a given seed. Handlers may schedule more events; ``run``
returns when none is left or the next one lies past ``until``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from typing import Any

from mooncake_diffusion.orchestrator.core.clock import VirtualClock

__all__ = ["EventQueue"]


class EventQueue:
    """Timed events that drive a ``VirtualClock``; single-threaded."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, t: float, kind: str, arg: Any = None) -> None:
        """Schedule ``handlers[kind](arg)`` at virtual time ``t``."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, arg))

    def run(self, handlers: Mapping[str, Callable[[Any], None]], until: float = math.inf) -> None:
        """Run events in time order; the clock never goes backwards. An unknown kind
        raises ``KeyError`` naming it."""
        while self._heap:
            t, _, kind, arg = heapq.heappop(self._heap)
            if t > until:
                return
            self.clock.set(max(t, self.clock.now()))
            handlers[kind](arg)

"""The running denoise jobs, as the preemption rule asks for them, without a scan.

Used only by the core (``OrchestratorConfig.preemption``):

    victims.started(req)     a denoise job was dispatched
    victims.stopped(req)     it is no longer running (done, failed, yielded, revoked,
                             or its worker is gone); call before ``req.preempting`` resets
    victims.pending          how many running jobs were asked to yield and have not
    victims.first()          the next victim in the rule's order, or None
    victims.take(req)        ``first()`` was asked to yield (sets ``req.preempting``)

Victim order: lowest-priority class first, then the most recently started, then
the request id; only jobs not already asked and preempted fewer than
``max_preemptions`` times. A heap with lazy deletion (an entry is current while
its job runs the same attempt, not asked yet), rebuilt from the running jobs when
stale entries outnumber them: O(log n) per dispatch and per victim, amortised.
"""

from __future__ import annotations

import heapq
from typing import Any

__all__ = ["Victims"]


class Victims:
    def __init__(self, max_preemptions: int) -> None:
        self._max = max_preemptions
        self.running: dict[str, Any] = {}  # request id -> its record, while at denoise
        self.pending = 0
        self._heap: list[tuple[int, float, str, int, Any]] = []
        self._seq = 0

    def started(self, req: Any) -> None:
        self.running[req.rid] = req
        if req.yields < self._max:
            if len(self._heap) > 2 * len(self.running) + 16:
                self._rebuild()
            self._push(req)

    def stopped(self, req: Any) -> None:
        if self.running.pop(req.rid, None) is not None and req.preempting:
            self.pending -= 1

    def first(self) -> Any | None:
        heap = self._heap
        while heap:
            _, neg_started, rid, _, req = heap[0]
            if self.running.get(rid) is req and not req.preempting and req.started == -neg_started:
                return req
            heapq.heappop(heap)
        return None

    def take(self, req: Any) -> None:
        heapq.heappop(self._heap)  # ``req`` was ``first()``: it is the top
        req.preempting = True
        self.pending += 1

    def _push(self, req: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (-req.cls.priority, -req.started, req.rid, self._seq, req))

    def _rebuild(self) -> None:
        self._heap.clear()
        for req in self.running.values():
            if not req.preempting and req.yields < self._max:
                self._push(req)

"""One stage's queue: strict priority between SLO classes, FIFO within a class,
and a bounded wait for every class that sets ``max_wait``.

    q = ClassQueue(config.classes)
    token = q.push(request, "batch", since=now)   # core: an item becomes ready
    q.discard(token, "batch")                     # core: cancel of a queued item
    request = q.pop(now)                          # core: one dispatch decision

Order of ``pop`` at time ``now``: among the head (oldest item) of each class,

1. an *overdue* head, one with ``now - since >= max_wait``, wins; among several,
   the one that became overdue first (``since + max_wait``), then push order;
2. otherwise the head of the class with the lowest ``priority``; equal
   priorities go oldest first.

The bound: an item of a class with ``max_wait = W`` that was pushed with
``since = t`` is, at any pop at or after ``t + W``, behind only items that
became overdue no later than it did (overdue heads are served in that order,
and its own class is FIFO). With none of those waiting it is the very next
item served once the stage has a free credit after ``t + W``: its wait is at
most ``W`` plus the time until then. Higher-priority traffic cannot extend it.

``since`` is when the item first became ready for this stage; a re-queued item
keeps it, so retries are not sent to the back. Lazy deletion: ``discard`` is
O(1). Each class keeps its items in ``(since, push order)`` order in two parts: a
FIFO of the pushes that came in that order (the common case: an item becomes
ready *now*, after every item already queued), O(1) to push and pop, and a heap
of the rest (re-queued items, older), O(log n); ``pop`` takes the smaller head.
A fleet's queue of thousands then costs a pop no walk down a heap (each level a
cache miss). Not thread-safe (the core is single-threaded).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from mooncake_diffusion.orchestrator.core.model import SloClass

__all__ = ["ClassQueue"]

T = TypeVar("T")
_Fifo = tuple[deque[float], deque[int]]  # a class's in-order pushes: since, token


class ClassQueue(Generic[T]):
    """Priority + aging queue over a fixed set of SLO classes (see the module docstring)."""

    def __init__(self, classes: Sequence[SloClass]) -> None:
        # stable sort: equal priorities keep the configured order (ties break by age anyway)
        self._classes = sorted(classes, key=lambda c: c.priority)
        #: per class: pushes in (since, seq) order, and the out-of-order rest (a heap)
        #: (a FIFO is two deques, ``since`` and ``seq``: numbers, no tuple per entry for
        #: the garbage collector to visit)
        self._fifos: dict[str, _Fifo] = {c.name: (deque(), deque()) for c in classes}
        self._heaps: dict[str, list[tuple[float, int]]] = {c.name: [] for c in classes}
        #: the queued items by token; read-only outside (its truth is whether anything
        #: is queued, read without a call: the core asks at every dispatch)
        self.live: dict[int, T] = {}
        self._seq = 0
        #: tokens made ahead, 1,024 at a time, so their int objects lie side by side (a
        #: fleet's queue of thousands reads each head token's object at a pop)
        self._spare: list[int] = []
        self._priority = {c.name: c.priority for c in classes}
        self._counts: dict[str, int] = {c.name: 0 for c in classes}

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self) -> Iterator[T]:
        """Queued items in push order (not service order)."""
        return iter(self.live.values())

    def push(self, item: T, slo_class: str, since: float) -> int:
        """Queue ``item``; returns the token that ``discard`` takes. ``slo_class`` must be known."""
        if not self._spare:
            self._spare = list(range(self._seq + 1024, self._seq, -1))
        seq = self._seq = self._spare.pop()
        fsince, fseq = self._fifos[slo_class]
        if not fsince or fsince[-1] <= since:  # after every entry: (since, seq) grows
            fsince.append(since)
            fseq.append(seq)
        else:
            heapq.heappush(self._heaps[slo_class], (since, seq))
        self.live[seq] = item
        self._counts[slo_class] += 1
        return seq

    def discard(self, token: int, slo_class: str) -> None:
        """Forget a queued item of ``slo_class`` (the class it was pushed with); a token
        already popped or discarded is ignored."""
        if self.live.pop(token, None) is not None:
            self._counts[slo_class] -= 1

    def waiting_better_than(self, priority: int) -> int:
        """How many queued items belong to classes served before ``priority``. O(classes)."""
        return sum(n for name, n in self._counts.items() if self._priority[name] < priority)

    def pop(self, now: float) -> T | None:
        """Remove and return the next item to serve at ``now``, or ``None`` if empty.

        A head's ``since`` is read only where it decides: for a class with a
        ``max_wait`` (is it overdue?) and between classes of equal priority. (On a
        fleet, a head was pushed thousands of events ago: each float read, even to
        put it in a tuple, is a cache miss.)"""
        live = self.live
        if not live:
            return None
        first: SloClass | None = None  # the class of the best head by priority
        first_at = (0, False)  # that head: (token, from the FIFO)
        late: tuple[float, int, SloClass, bool] | None = None  # the overdue head due first
        for c in self._classes:
            name = c.name
            h = self._heaps[name]
            while h and h[0][1] not in live:
                heapq.heappop(h)
            fsince, fseq = self._fifos[name]
            while fseq and fseq[0] not in live:
                fsince.popleft()
                fseq.popleft()
            if fseq and (not h or (fsince[0], fseq[0]) < h[0]):
                seq, from_fifo = fseq[0], True
            elif h:
                seq, from_fifo = h[0][1], False
            else:
                continue
            wait = c.max_wait
            if wait is not None:
                since = fsince[0] if from_fifo else h[0][0]
                if now - since >= wait:  # overdue: served by when it became so
                    due = since + wait
                    if late is None or (due, seq) < late[:2]:
                        late = (due, seq, c, from_fifo)
            if first is None or (
                c.priority == first.priority
                and self._head_key(c, seq, from_fifo) < self._head_key(first, *first_at)
            ):
                first, first_at = c, (seq, from_fifo)
        if late is not None:
            _, seq, cls, from_fifo = late
        else:
            assert first is not None
            cls, (seq, from_fifo) = first, first_at
        fsince, fseq = self._fifos[cls.name]
        if from_fifo:
            fsince.popleft()
            fseq.popleft()
        else:
            heapq.heappop(self._heaps[cls.name])
        self._counts[cls.name] -= 1
        return live.pop(seq)

    def _head_key(self, c: SloClass, seq: int, from_fifo: bool) -> tuple[float, int]:
        """``(since, token)`` of class ``c``'s head ``seq`` (ties between equal priorities)."""
        since = self._fifos[c.name][0][0] if from_fifo else self._heaps[c.name][0][0]
        return since, seq

"""Routing indexes: the built-in policies' choices without scanning the pool.

A policy's ``choose(item, candidates)`` (``policy.py``) reads every worker
with a free credit, so a decision costs O(workers). A policy that also has an
``index()`` method hands the core a ``RoutingIndex``; the core's ``Pools``
then tells it about every change of a worker (``update``: registered, or its
credits changed; ``remove``: gone), and each decision asks ``pick(item)``:

    index = policy.index()           # once per core
    index.update(w) / index.remove(w) # by Pools, as credits move
    w = index.pick(item)             # per decision: the worker choose() would return

A worker that holds several stages (``w.stages``) is a member of each of
those stages' structures; ``update`` and ``remove`` cost that many times the
figures below. The core calls ``remove`` when a worker stops serving (it is
changing stage or draining) and never ``update`` until it serves again.

Obligation: ``pick(item)`` returns exactly the worker that
``policy.choose(item, candidates)`` would, for the same state and call
sequence (tests check this against ``choose`` on random event sequences), or
``None`` when no worker of the stage has a free credit.

Costs, with n workers in a stage: round robin keeps the free workers' sequence
numbers sorted (``bisect``: O(log n) comparisons and a memmove of at most n
pointers per change). Least loaded keeps a heap per stage with lazy deletion:
O(log n) per change and per pick, amortised, its stale entries dropped in one
pass when they outnumber the members. Affinity keeps one such heap per
(stage, set of matched label keys, their values): 2**k heaps per worker for k
affinity keys (8 for node/rail/numa), and a pick looks at most 2**k of them,
best score first.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from collections.abc import Mapping
from typing import Protocol

from mooncake_diffusion.orchestrator.model import WorkItem
from mooncake_diffusion.orchestrator.policy import WorkerView

__all__ = ["AffinityIndex", "LeastLoadedIndex", "RoundRobinIndex", "RoutingIndex"]


class RoutingIndex(Protocol):
    """What ``Pools`` maintains and the core asks (see the module docstring)."""

    def update(self, w: WorkerView) -> None: ...
    def remove(self, w: WorkerView) -> None: ...
    def pick(self, item: WorkItem) -> WorkerView | None: ...


class RoundRobinIndex:
    """The free workers of each stage by sequence number; the cursor is the policy's."""

    def __init__(self, last: dict[str, int]) -> None:
        self._last = last  # shared with RoundRobin.choose: one cursor per stage
        self._seqs: dict[str, list[int]] = {}
        self._free: dict[int, WorkerView] = {}

    def update(self, w: WorkerView) -> None:
        seq = w.seq
        if w.free > 0:
            if seq not in self._free:
                self._free[seq] = w
                for s in w.stages:
                    insort(self._seqs.setdefault(s, []), seq)
        elif seq in self._free:
            self.remove(w)

    def remove(self, w: WorkerView) -> None:
        seq = w.seq
        if self._free.pop(seq, None) is not None:
            for s in w.stages:
                seqs = self._seqs[s]
                del seqs[bisect_right(seqs, seq) - 1]

    def pick(self, item: WorkItem) -> WorkerView | None:
        seqs = self._seqs.get(item.stage)
        if not seqs:
            return None
        i = bisect_right(seqs, self._last.get(item.stage, -1))
        w = self._free[seqs[i] if i < len(seqs) else seqs[0]]
        self._last[item.stage] = w.seq
        return w


class _LoadHeap:
    """The least loaded free worker of a fixed group, with lazy deletion.

    Entries are ``(held/advertised, -free, seq, stamp)``: the least-loaded key
    of ``policies.py``, then the worker's stamp when the entry was made. An entry
    is current while ``stamps[seq]`` still equals its stamp (the owning index
    gives a worker a new stamp at every change, and none while it has no free
    credit). Entries hold numbers only, no worker (``_Stamps.free`` maps a seq to
    its worker): the garbage collector drops such tuples from its books at its
    first pass instead of rescanning a fleet's heaps at every collection.
    """

    __slots__ = ("heap", "limit", "members")

    def __init__(self) -> None:
        self.heap: list[_Entry] = []
        self.members: dict[int, WorkerView] = {}  # every live worker of the group
        self.limit = 16  # past this many entries, most are stale: compact

    def join(self, w: WorkerView) -> None:
        self.members[w.seq] = w
        self.limit = 2 * len(self.members) + 16

    def leave(self, w: WorkerView) -> None:
        self.members.pop(w.seq, None)
        self.limit = 2 * len(self.members) + 16

    def add(self, entry: _Entry, stamps: Mapping[int, int]) -> None:
        heap = self.heap
        if len(heap) > self.limit:
            self.compact(stamps)
        heapq.heappush(heap, entry)

    def compact(self, stamps: Mapping[int, int]) -> None:
        """Drop the stale entries, O(members): amortised over the pushes that made them."""
        heap = self.heap
        heap[:] = [e for e in heap if stamps.get(e[2]) == e[3]]
        heapq.heapify(heap)

    def best(self, stamps: _Stamps) -> WorkerView | None:
        heap, of = self.heap, stamps.of
        while heap:
            e = heap[0]
            if of.get(e[2]) == e[3]:
                return stamps.free[e[2]]
            heapq.heappop(heap)
        return None


_Entry = tuple[float, int, int, int]


class _Stamps:
    """Per worker (by seq) the stamp of its current entries, and the worker; absent:
    not free."""

    __slots__ = ("free", "next", "of")

    def __init__(self) -> None:
        self.of: dict[int, int] = {}
        self.free: dict[int, WorkerView] = {}
        self.next = 0

    def entry(self, w: WorkerView) -> _Entry | None:
        """A fresh entry for ``w`` (older ones go stale), or None if it has no free credit."""
        seq = w.seq
        if w.free <= 0:
            self.drop(seq)
            return None
        self.next += 1
        self.of[seq] = self.next
        self.free[seq] = w
        return (w.held / w.advertised, -w.free, seq, self.next)

    def drop(self, seq: int) -> None:
        """``seq``'s entries are stale from now on."""
        if self.of.pop(seq, None) is not None:
            del self.free[seq]


class LeastLoadedIndex:
    """One ``_LoadHeap`` per stage; a worker of several stages is in each one's heap."""

    def __init__(self) -> None:
        self._stamps = _Stamps()
        self._heaps: dict[str, _LoadHeap] = {}

    def update(self, w: WorkerView) -> None:
        heaps = []
        for s in w.stages:
            h = self._heaps.get(s)
            if h is None:
                h = self._heaps[s] = _LoadHeap()
            if w.seq not in h.members:
                h.join(w)
            heaps.append(h)
        e = self._stamps.entry(w)
        if e is not None:
            for h in heaps:
                h.add(e, self._stamps.of)

    def remove(self, w: WorkerView) -> None:
        self._stamps.drop(w.seq)
        for s in w.stages:
            h = self._heaps.get(s)
            if h is not None:
                h.leave(w)

    def pick(self, item: WorkItem) -> WorkerView | None:
        h = self._heaps.get(item.stage)
        return None if h is None else h.best(self._stamps)


_Group = tuple[str, int, tuple[str, ...]]  # stage, mask, the masked keys' values


class AffinityIndex:
    """A ``_LoadHeap`` per (stage, matched-key mask, those keys' values); a worker of
    several stages is in each stage's groups.

    Mask bit ``1 << (k - 1 - i)`` stands for ``keys[i]``, so masks compare as
    ``AffinityLeastLoaded.score`` does. A worker is in the group of every mask
    whose keys it has labels for; mask 0 is the whole stage (no hint). For a
    hint, the first group, in descending mask order over the keys the hint
    has, with a free worker holds exactly the workers of the best score (any
    worker scoring higher would be in a group looked at before), and its heap
    gives the least loaded of them. The groups to look at for one (stage,
    hint values) are cached until a group is made or dropped.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = keys
        self._stamps = _Stamps()
        self._groups: dict[_Group, _LoadHeap] = {}
        self._of: dict[int, list[tuple[_Group, _LoadHeap]]] = {}  # a worker's groups
        self._plans: dict[tuple[str, tuple[str | None, ...]], list[_LoadHeap]] = {}
        n = len(keys)
        #: (mask, indexes of its keys), best score first
        self._masks = [
            (m, tuple(i for i in range(n) if m >> (n - 1 - i) & 1))
            for m in range((1 << n) - 1, -1, -1)
        ]

    def update(self, w: WorkerView) -> None:
        groups = self._of.get(w.seq)
        if groups is None:
            groups = self._of[w.seq] = self._join(w)
        e = self._stamps.entry(w)
        if e is not None:
            stamps = self._stamps.of
            push = heapq.heappush
            for _, h in groups:
                if len(h.heap) > h.limit:
                    h.compact(stamps)
                push(h.heap, e)

    def _join(self, w: WorkerView) -> list[tuple[_Group, _LoadHeap]]:
        vals = tuple(map(w.labels.get, self._keys))
        out: list[tuple[_Group, _LoadHeap]] = []
        for stage in w.stages:
            for m, bits in self._masks:
                if all(vals[i] is not None for i in bits):
                    key = (stage, m, tuple(vals[i] for i in bits))
                    h = self._groups.get(key)
                    if h is None:
                        h = self._groups[key] = _LoadHeap()
                        self._plans.clear()
                    h.join(w)
                    out.append((key, h))
        return out  # type: ignore[return-value]

    def remove(self, w: WorkerView) -> None:
        self._stamps.drop(w.seq)
        for key, h in self._of.pop(w.seq, ()):
            h.leave(w)
            if not h.members:  # no worker has these labels any more
                del self._groups[key]
                self._plans.clear()

    def pick(self, item: WorkItem) -> WorkerView | None:
        hint = item.hint
        vals = tuple(map(hint.get, self._keys)) if hint else (None,) * len(self._keys)
        plan = self._plans.get((item.stage, vals))
        if plan is None:
            plan = self._plans[(item.stage, vals)] = self._plan(item.stage, vals)
        stamps = self._stamps.of
        for h in plan:
            heap = h.heap
            while heap:  # h.best(stamps), inline: this is the per-decision path
                e = heap[0]
                if stamps.get(e[2]) == e[3]:
                    return self._stamps.free[e[2]]
                heapq.heappop(heap)
        return None

    def _plan(self, stage: str, vals: tuple[str | None, ...]) -> list[_LoadHeap]:
        """The existing groups a hint with ``vals`` matches, best score first."""
        plan = []
        for m, bits in self._masks:
            if all(vals[i] is not None for i in bits):
                h = self._groups.get((stage, m, tuple(vals[i] for i in bits)))  # type: ignore[misc]
                if h is not None:
                    plan.append(h)
        if len(self._plans) > 4096:  # hints from many label sets: bound the cache
            self._plans.clear()
        return plan

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
pointers per change). Least loaded keeps a ``_LoadHeap`` per stage: a heap of
worker sequence numbers per credit level (held, advertised), the levels in load
order, with lazy deletion: O(log n) per change and per pick, amortised, a
bucket's stale entries dropped in one pass when they outnumber the members; a
change that leaves a free worker's level as it was costs no push. Affinity keeps
one such structure per (stage, set of matched label keys, their values): 2**k
per worker for k affinity keys (8 for node/rail/numa), and a pick looks at most
2**k of them, best score first. Heaps of ints, not of ``(load, -free, seq)``
tuples: on a fleet of thousands every tuple a heap operation reads is a cache
miss, and the collector would keep visiting them.
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

    The least-loaded key of ``policies.py`` is ``(held/advertised, -free, seq)``.
    Workers are bucketed by its first two parts (``_Key``; a fleet has a few:
    one per credit level), each bucket a heap of seqs, the buckets in key order
    (``order``): the best worker is the smallest seq of the first bucket that
    holds a current one. An entry ``seq`` in bucket ``key`` is current while
    ``keys[seq] is key`` (``_Stamps``: a worker's key now; absent when it has no
    free credit). A bucket lives as long as its group, so the workers of the same
    groups keep the buckets they push to (``_Lanes``, shared: ``_LaneSets``) and an
    update costs a push per group, no lookup. A heap of ints compares without
    reading cold memory; the tuples of a heap of ``(load, -free, seq)`` entries
    are each a cache miss in a fleet of thousands, and a worker freed goes to the
    top of the heap.
    """

    __slots__ = ("buckets", "limit", "members", "order")

    def __init__(self) -> None:
        self.buckets: dict[_Key, list[int]] = {}
        self.order: list[tuple[_Key, list[int]]] = []  # (key, its bucket), ascending keys
        self.members: dict[int, WorkerView] = {}  # every live worker of the group
        self.limit = 16  # past this many entries in a bucket, most are stale: compact

    def join(self, w: WorkerView) -> None:
        self.members[w.seq] = w
        self.limit = 2 * len(self.members) + 16

    def leave(self, w: WorkerView) -> None:
        self.members.pop(w.seq, None)
        self.limit = 2 * len(self.members) + 16

    def bucket(self, key: _Key) -> list[int]:
        """The bucket of ``key``, made (in its place in ``order``) if new."""
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = []
            self.order.insert(bisect_right([k for k, _ in self.order], key), (key, b))
        return b

    def best(self, keys: Mapping[int, _Key]) -> int | None:
        """The seq of the least loaded free worker, or None."""
        for key, b in self.order:
            while b:
                s = b[0]
                if keys.get(s) is key:
                    return s
                heapq.heappop(b)
        return None


_Key = tuple[float, int]  # (held / advertised, -free)
_Lanes = dict[_Key, list[tuple[_LoadHeap, list[int]]]]  # a worker's buckets, per key


class _LaneSets:
    """The buckets a worker pushes to, per key, shared by every worker of the same
    groups (``heaps``): workers of one stage with the same labels, of which a fleet
    has few. A worker's update then reads lanes that other workers' updates keep in
    the CPU's cache; a lane per worker was a cold read per decision on a fleet of
    thousands. A set of groups is forgotten with its last worker (``leave``), so a
    group dropped by ``AffinityIndex`` is not kept alive here."""

    __slots__ = ("lanes", "users")

    def __init__(self) -> None:
        self.lanes: dict[tuple[_LoadHeap, ...], _Lanes] = {}
        self.users: dict[tuple[_LoadHeap, ...], int] = {}

    def join(self, heaps: tuple[_LoadHeap, ...]) -> _Lanes:
        """One more worker of ``heaps``; its lanes."""
        self.users[heaps] = self.users.get(heaps, 0) + 1
        lanes = self.lanes.get(heaps)
        if lanes is None:
            lanes = self.lanes[heaps] = {}
        return lanes

    def leave(self, heaps: tuple[_LoadHeap, ...]) -> None:
        """A worker of ``heaps`` left; the last one takes the lanes with it."""
        left = self.users[heaps] - 1
        if left:
            self.users[heaps] = left
        else:
            del self.users[heaps], self.lanes[heaps]


class _Stamps:
    """Per free worker (by seq) its ``_Key`` now, and the worker. One tuple per
    (held, advertised, free) is made and reused, so keys compare by identity."""

    __slots__ = ("free", "made", "of")

    def __init__(self) -> None:
        self.of: dict[int, _Key] = {}
        self.free: dict[int, WorkerView] = {}
        self.made: dict[tuple[int, int, int], _Key] = {}

    def update(self, w: WorkerView, heaps: tuple[_LoadHeap, ...], lanes: _Lanes) -> None:
        """``w`` changed: note its key (entries under any other key go stale) and push
        its seq into that key's bucket of each of ``heaps`` (its groups), unless the
        key is the one its current entries have; no free credit: all its entries go
        stale. A bucket past its group's limit is rebuilt first without its stale
        entries and repeats, O(entries), amortised over the pushes that made them."""
        seq = w.seq
        of = self.of
        if w.free <= 0:
            if of.pop(seq, None) is not None:
                del self.free[seq]
            return
        held, adv, free = w.held, w.advertised, w.free
        key = self.made.get((held, adv, free))
        if key is None:
            key = self.made[(held, adv, free)] = (held / adv, -free)
        if of.get(seq) is key:
            return  # its entries stand
        of[seq] = key
        self.free[seq] = w
        lane = lanes.get(key)
        if lane is None:
            lane = lanes[key] = [(h, h.bucket(key)) for h in heaps]
        push = heapq.heappush
        for h, b in lane:
            if len(b) > h.limit:
                b[:] = sorted({s for s in b if of.get(s) is key})  # sorted: a heap
            push(b, seq)

    def drop(self, seq: int) -> None:
        """``seq``'s entries are stale from now on."""
        if self.of.pop(seq, None) is not None:
            del self.free[seq]


class LeastLoadedIndex:
    """One ``_LoadHeap`` per stage; a worker of several stages is in each one's heap."""

    def __init__(self) -> None:
        self._stamps = _Stamps()
        self._lanes = _LaneSets()
        self._heaps: dict[str, _LoadHeap] = {}
        self._of: dict[int, tuple[tuple[_LoadHeap, ...], _Lanes]] = {}  # a worker's heaps

    def update(self, w: WorkerView) -> None:
        mine = self._of.get(w.seq)
        if mine is None:
            heaps = []
            for s in w.stages:
                h = self._heaps.get(s)
                if h is None:
                    h = self._heaps[s] = _LoadHeap()
                h.join(w)
                heaps.append(h)
            mine = self._of[w.seq] = (tuple(heaps), self._lanes.join(tuple(heaps)))
        self._stamps.update(w, *mine)

    def remove(self, w: WorkerView) -> None:
        self._stamps.drop(w.seq)
        mine = self._of.pop(w.seq, None)
        if mine is not None:
            self._lanes.leave(mine[0])
        for s in w.stages:
            h = self._heaps.get(s)
            if h is not None:
                h.leave(w)

    def pick(self, item: WorkItem) -> WorkerView | None:
        h = self._heaps.get(item.stage)
        seq = None if h is None else h.best(self._stamps.of)
        return None if seq is None else self._stamps.free[seq]


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
        self._lanes = _LaneSets()
        self._groups: dict[_Group, _LoadHeap] = {}
        #: a worker's groups (by key, and their heaps in the same order) and buckets
        self._of: dict[int, tuple[list[_Group], tuple[_LoadHeap, ...], _Lanes]] = {}
        self._plans: dict[tuple[str, tuple[str | None, ...]], list[_LoadHeap]] = {}
        n = len(keys)
        #: (mask, indexes of its keys), best score first
        self._masks = [
            (m, tuple(i for i in range(n) if m >> (n - 1 - i) & 1))
            for m in range((1 << n) - 1, -1, -1)
        ]

    def update(self, w: WorkerView) -> None:
        mine = self._of.get(w.seq)
        if mine is None:
            mine = self._of[w.seq] = self._join(w)
        self._stamps.update(w, mine[1], mine[2])

    def _join(self, w: WorkerView) -> tuple[list[_Group], tuple[_LoadHeap, ...], _Lanes]:
        vals = tuple(map(w.labels.get, self._keys))
        groups: list[_Group] = []
        heaps: list[_LoadHeap] = []
        for stage in w.stages:
            for m, bits in self._masks:
                if all(vals[i] is not None for i in bits):
                    key = (stage, m, tuple(vals[i] for i in bits))
                    h = self._groups.get(key)
                    if h is None:
                        h = self._groups[key] = _LoadHeap()
                        self._plans.clear()
                    h.join(w)
                    groups.append(key)  # type: ignore[arg-type]
                    heaps.append(h)
        return groups, tuple(heaps), self._lanes.join(tuple(heaps))

    def remove(self, w: WorkerView) -> None:
        self._stamps.drop(w.seq)
        mine = self._of.pop(w.seq, None)
        if mine is None:
            return
        groups, heaps, _ = mine
        self._lanes.leave(heaps)
        for key, h in zip(groups, heaps, strict=True):
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
        keys = self._stamps.of
        for h in plan:
            for key, b in h.order:  # h.best(keys), inline: the per-decision path
                while b:
                    s = b[0]
                    if keys.get(s) is key:
                        return self._stamps.free[s]
                    heapq.heappop(b)
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

"""Routing indexes: the built-in policies' choices without scanning the pool.

A policy's ``choose(item, candidates)`` (``routing.py``) reads every worker
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
numbers in two heaps around its cursor, with lazy deletion (O(log n) per change
and per pick, amortised). Least loaded keeps a ``_LoadHeap`` per stage: a heap of
worker sequence numbers per credit level (held, advertised), the levels in load
order, with lazy deletion: O(log n) per change and per pick, amortised, a
bucket's stale entries dropped in one pass when they outnumber the members; a
change that leaves a free worker's level as it was costs no push. Affinity keeps
one such structure per (stage, set of matched label keys, their values): 2**k
per worker for k affinity keys (8 for node/rail/numa), and a pick looks at most
2**k of them, best score first. Heaps of ints, not of ``(load, -free, seq)``
tuples: on a fleet of thousands every tuple a heap operation reads is a cache
miss, and the collector would keep visiting them.

Memory: the built-in indexes take the core's own workers (``pools.Worker``) and
keep what they know of each in its ``routing`` slot rather than in tables by
worker number, which on a fleet of thousands cost a cache miss per lookup; no
structure a worker refers to through it refers back to the worker (numbers, not
workers), so a worker and its index state go by reference counting.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Mapping
from typing import Any, Protocol

from mooncake_diffusion.orchestrator.core.interned import Interned
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.core.routing import WorkerView

__all__ = ["AffinityIndex", "LeastLoadedIndex", "RoundRobinIndex", "RoutingIndex"]


class RoutedWorker(WorkerView, Protocol):
    """A worker as the built-in indexes take it (the core's ``pools.Worker``): a view
    with a ``routing`` slot the index owns (None until the index first sees it)."""

    routing: Any


class RoutingIndex(Protocol):
    """What ``Pools`` maintains and the core asks (see the module docstring)."""

    def update(self, w: WorkerView) -> None: ...
    def remove(self, w: WorkerView) -> None: ...
    def pick(self, item: WorkItem) -> WorkerView | None: ...


class _Ring:
    """One stage's free workers for round robin: the seqs after the cursor (``ahead``)
    and those at or before it (``behind``), two heaps with lazy deletion. An entry
    stands while its worker is free (``RoundRobinIndex._free``); a worker freed again
    before its old entry came up leaves two, and a copy at or before the cursor in
    ``ahead`` is the one just picked (its place is in ``behind``): dropped. A heap
    past ``2 n + 16`` entries for ``n`` free workers is rebuilt (``compact``)."""

    __slots__ = ("ahead", "behind", "cursor")

    def __init__(self, cursor: int) -> None:
        self.ahead: list[int] = []
        self.behind: list[int] = []
        self.cursor = cursor  # the policy's cursor the split was made at

    def compact(self, h: list[int], free: Mapping[int, Any]) -> None:
        """Rebuild ``h`` (past ``2 n + 16`` entries for ``n`` free workers: mostly
        stale) without its stale entries and repeats."""
        low = self.cursor if h is self.ahead else -1
        h[:] = sorted({s for s in h if s > low and s in free})  # sorted: a heap

    def split(self, cursor: int, free: Mapping[int, Any]) -> None:
        """The cursor moved outside ``pick`` (``RoundRobin.choose``): split anew."""
        seqs = sorted({s for s in (*self.ahead, *self.behind) if s in free})
        self.ahead = [s for s in seqs if s > cursor]
        self.behind = [s for s in seqs if s <= cursor]
        self.cursor = cursor


class RoundRobinIndex:
    """The free workers of each stage in two heaps around the policy's cursor
    (``_Ring``): a pick pops the smallest free seq after the cursor, and when none is
    left, the heap of those before it becomes the next round. Whether a worker is
    listed is noted on it (``w.routing``), not looked up. (A sorted list with
    ``bisect`` moved up to n pointers per change: on a fleet of 3,072 denoise
    workers, half of them idle, about 12 KB per dispatch and per completion.)"""

    def __init__(self, last: dict[str, int]) -> None:
        self._last = last  # shared with RoundRobin.choose: one cursor per stage
        self._rings: dict[str, _Ring] = {}
        self._free: dict[int, RoutedWorker] = {}

    def update(self, w: RoutedWorker) -> None:
        if w.free > 0:
            if not w.routing:
                w.routing = True
                seq = w.seq
                free = self._free
                free[seq] = w
                for s in w.stages:
                    r = self._rings.get(s)
                    if r is None:
                        r = self._rings[s] = _Ring(self._last.get(s, -1))
                    h = r.ahead if seq > r.cursor else r.behind
                    heapq.heappush(h, seq)
                    if len(h) > 2 * len(free) + 16:
                        r.compact(h, free)
        elif w.routing:
            self.remove(w)

    def remove(self, w: RoutedWorker) -> None:
        if w.routing:
            w.routing = None
            del self._free[w.seq]  # its entries are stale from now on

    def pick(self, item: WorkItem) -> RoutedWorker | None:
        stage = item.stage
        r = self._rings.get(stage)
        if r is None:
            return None
        free = self._free
        last = self._last.get(stage, -1)
        if last != r.cursor:
            r.split(last, free)
        ahead = r.ahead
        while ahead:
            seq = ahead[0]
            if seq > last and seq in free:
                break
            heapq.heappop(ahead)
        else:  # every free worker is at or before the cursor: the next round
            ahead = r.ahead = r.behind
            r.behind = []
            while ahead and ahead[0] not in free:
                heapq.heappop(ahead)
            if not ahead:
                return None
        seq = heapq.heappop(ahead)
        heapq.heappush(r.behind, seq)  # it may stay free: at or before the cursor now
        r.cursor = self._last[stage] = seq
        return free[seq]


class _LoadHeap:
    """The least loaded free worker of a fixed group, with lazy deletion.

    The least-loaded key of ``policies.py`` is ``(held/advertised, -free, seq)``.
    Workers are bucketed by its first two parts (``_Key``; a fleet has a few:
    one per credit level), each bucket a heap of seqs, the buckets in key order
    (``order``): the best worker is the smallest seq of the first bucket that
    holds a current one. An entry ``seq`` in bucket ``key`` is current while its
    worker is free with ``key`` its key now (``w.routing.key``, ``_Routed``; None
    when it has no free credit). A bucket lives as long as its group, so the workers of the same
    groups keep the buckets they push to (``_Lanes``, shared: ``Interned``) and an
    update costs a push per group, no lookup. A heap of ints compares without
    reading cold memory; the tuples of a heap of ``(load, -free, seq)`` entries
    are each a cache miss in a fleet of thousands, and a worker freed goes to the
    top of the heap.
    """

    __slots__ = ("buckets", "limit", "members", "order")

    def __init__(self) -> None:
        self.buckets: dict[_Key, list[int]] = {}
        self.order: list[tuple[_Key, list[int]]] = []  # (key, its bucket), ascending keys
        #: the seqs of every live worker of the group (numbers, not workers: a worker
        #: refers to its heaps through ``w.routing``, and no cycle may run back)
        self.members: set[int] = set()
        self.limit = 16  # past this many entries in a bucket, most are stale: compact

    def join(self, w: WorkerView) -> None:
        self.members.add(w.seq)
        self.limit = 2 * len(self.members) + 16

    def leave(self, w: WorkerView) -> None:
        self.members.discard(w.seq)
        self.limit = 2 * len(self.members) + 16

    def bucket(self, key: _Key) -> list[int]:
        """The bucket of ``key``, made (in its place in ``order``) if new."""
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = []
            self.order.insert(bisect_right([k for k, _ in self.order], key), (key, b))
        return b

    def best(self, free: Mapping[int, RoutedWorker]) -> RoutedWorker | None:
        """The least loaded free worker (``free``: ``_Stamps.free``), or None."""
        for key, b in self.order:
            while b:
                w = free.get(b[0])
                if w is not None and w.routing.key is key:
                    return w
                heapq.heappop(b)
        return None


_Key = tuple[float, int]  # (held / advertised, -free)
_Lanes = dict[_Key, list[tuple[_LoadHeap, list[int]]]]  # a worker's buckets, per key


#: a worker's lanes are shared by every worker of the same groups (``heaps``): workers
#: of one stage with the same labels, of which a fleet has few. A worker's update then
#: reads lanes that other workers' updates keep in the CPU's cache; a lane per worker
#: was a cold read per decision on a fleet of thousands. The lanes of a set of groups
#: go with its last worker, so a group dropped by ``AffinityIndex`` is not kept alive.
_LaneSets = Interned[tuple[_LoadHeap, ...], _Lanes]  # heaps -> their lanes


class _Routed:
    """What a least-loaded or affinity index keeps on a worker (``w.routing``): its
    ``_Key`` now (``None``: no free credit; entries under any other key are stale),
    its groups' heaps, their lanes and (affinity) the groups' names. On the worker,
    not in tables by worker number: a decision reads the worker anyway, where a
    lookup in a table of thousands was a cache miss."""

    __slots__ = ("groups", "heaps", "key", "lanes")

    def __init__(
        self, heaps: tuple[_LoadHeap, ...], lanes: _Lanes, groups: tuple[_Group, ...] = ()
    ) -> None:
        self.key: _Key | None = None
        self.heaps = heaps
        self.lanes = lanes
        self.groups = groups


class _Stamps:
    """The free workers by seq (their keys are on them: ``_Routed``). One key tuple per
    (held, advertised, free) is made and reused, so keys compare by identity."""

    __slots__ = ("free", "made")

    def __init__(self) -> None:
        self.free: dict[int, RoutedWorker] = {}
        self.made: dict[tuple[int, int, int], _Key] = {}

    def update(self, w: RoutedWorker, r: _Routed) -> None:
        """``w`` changed: note its key (entries under any other key go stale) and push
        its seq into that key's bucket of each of its groups' heaps, unless the key
        is the one its current entries have; no free credit: all its entries go
        stale. A bucket past its group's limit is rebuilt first without its stale
        entries and repeats, O(entries), amortised over the pushes that made them."""
        if w.free <= 0:
            return self.drop(w, r)
        held, adv, free = w.held, w.advertised, w.free
        key = self.made.get((held, adv, free))
        if key is None:
            key = self.made[(held, adv, free)] = (held / adv, -free)
        if r.key is key:
            return  # its entries stand
        seq = w.seq
        if r.key is None:
            self.free[seq] = w
        r.key = key
        lane = r.lanes.get(key)
        if lane is None:
            lane = r.lanes[key] = [(h, h.bucket(key)) for h in r.heaps]
        push = heapq.heappush
        for h, b in lane:
            if len(b) > h.limit:
                b[:] = self.standing(b, key)
            push(b, seq)

    def standing(self, bucket: list[int], key: _Key) -> list[int]:
        """The entries of ``bucket`` (under ``key``) that stand, once each, sorted (a
        heap): an entry stands while its worker is free with ``key`` its key now."""
        free = self.free
        return sorted(
            {s for s in bucket if (w := free.get(s)) is not None and w.routing.key is key}
        )

    def drop(self, w: RoutedWorker, r: _Routed) -> None:
        """``w``'s entries are stale from now on."""
        if r.key is not None:
            r.key = None
            del self.free[w.seq]


class LeastLoadedIndex:
    """One ``_LoadHeap`` per stage; a worker of several stages is in each one's heap."""

    def __init__(self) -> None:
        self._stamps = _Stamps()
        self._lanes: _LaneSets = Interned()
        self._heaps: dict[str, _LoadHeap] = {}

    def update(self, w: RoutedWorker) -> None:
        r = w.routing
        if r is None:
            heaps = []
            for s in w.stages:
                h = self._heaps.get(s)
                if h is None:
                    h = self._heaps[s] = _LoadHeap()
                h.join(w)
                heaps.append(h)
            mine = tuple(heaps)
            r = w.routing = _Routed(mine, self._lanes.hold(mine, {}))
        self._stamps.update(w, r)

    def remove(self, w: RoutedWorker) -> None:
        r = w.routing
        if r is not None:
            self._stamps.drop(w, r)
            self._lanes.drop(r.heaps)
            w.routing = None
        for s in w.stages:
            h = self._heaps.get(s)
            if h is not None:
                h.leave(w)

    def pick(self, item: WorkItem) -> RoutedWorker | None:
        h = self._heaps.get(item.stage)
        return None if h is None else h.best(self._stamps.free)


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
        self._lanes: _LaneSets = Interned()
        self._groups: dict[_Group, _LoadHeap] = {}
        self._plans: dict[tuple[str, tuple[str | None, ...]], list[_LoadHeap]] = {}
        n = len(keys)
        #: (mask, indexes of its keys), best score first
        self._masks = [
            (m, tuple(i for i in range(n) if m >> (n - 1 - i) & 1))
            for m in range((1 << n) - 1, -1, -1)
        ]

    def update(self, w: RoutedWorker) -> None:
        r = w.routing
        if r is None:
            r = w.routing = self._join(w)
        self._stamps.update(w, r)

    def _join(self, w: RoutedWorker) -> _Routed:
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
        mine = tuple(heaps)
        return _Routed(mine, self._lanes.hold(mine, {}), tuple(groups))

    def remove(self, w: RoutedWorker) -> None:
        r = w.routing
        if r is None:
            return
        self._stamps.drop(w, r)
        self._lanes.drop(r.heaps)
        w.routing = None
        for key, h in zip(r.groups, r.heaps, strict=True):
            h.leave(w)
            if not h.members:  # no worker has these labels any more
                del self._groups[key]
                self._plans.clear()

    def pick(self, item: WorkItem) -> RoutedWorker | None:
        hint = item.hint
        vals = tuple(map(hint.get, self._keys)) if hint else (None,) * len(self._keys)
        plan = self._plans.get((item.stage, vals))
        if plan is None:
            plan = self._plans[(item.stage, vals)] = self._plan(item.stage, vals)
        free = self._stamps.free
        for h in plan:
            for key, b in h.order:  # h.best(free), inline: the per-decision path
                while b:
                    w = free.get(b[0])
                    if w is not None and w.routing.key is key:
                        return w
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

"""Worker pools: who is alive, in which stages, and how many credits each has free.

Used only by the core, which calls, per event:

    pools.expired(now)                  first: workers past their heartbeat deadline
    pools.add(...) / pools.remove(w)    RegisterWorker / WorkerLost, expiry, a drain done
    pools.touch(w, now)                 any event from a live worker
    pools.advertise(w, credits)         RegisterWorker / Heartbeat(credits=...)
    pools.hold(w) / pools.release(w)    a dispatch / that item done, failed or revoked
    pools.set_state(w, state)           Reassign / Drain / LoadStages: it stops serving
    pools.candidates(stage)             per decision, for a policy without an index:
                                        serving workers with a free credit, O(workers)

A worker holds one or more stages (``stages``; ``stage`` is the first) and one
set of credits (one GPU) shared by all of them: it is a member of every one of
its stages' pools, and one free credit counts once in each of those stages'
``free_total``. Only a ``serving`` worker takes work: a worker changing stage,
loading its new models or draining keeps its record (heartbeats, running items,
credits) but counts in no ``free_total`` and is out of the routing index.

With a routing index (``indexes.py``), every membership and credit change is
reported to it (``index.update(w)`` / ``index.remove(w)``) so the core's
decisions need no scan; ``candidates`` is then never called.

Credits: a worker advertises ``advertised`` receive slots; each running item
holds one. ``free = max(0, advertised - held)``: a lower advertisement never
revokes held credits, it retires them as their items finish. ``free_total``
per stage is kept incrementally (O(stages of the worker) per change) so "can
anything be dispatched?" is O(1).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from mooncake_diffusion.orchestrator.core.interned import Interned
from mooncake_diffusion.orchestrator.core.model import STAGES, Stage, WorkerState

if TYPE_CHECKING:
    from mooncake_diffusion.orchestrator.core.indexes import RoutingIndex

__all__ = ["Pools", "Worker"]


class Worker:
    """A live worker's record (satisfies ``routing.WorkerView``). Mutated only by ``Pools``."""

    __slots__ = (
        "advertised",
        "counted",
        "expires_at",
        "free",
        "held",
        "labels",
        "owner",
        "reason",
        "routing",
        "running",
        "seq",
        "stages",
        "state",
        "target",
        "timeout",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: str,
        stages: tuple[Stage, ...],
        seq: int,
        labels: dict[str, str],
        timeout: float,
    ) -> None:
        self.worker_id = worker_id
        self.stages = stages
        self.state: WorkerState = "serving"
        #: the stages a ``Reassign`` moves it to, and why (set while ``changing``/``loading``)
        self.target: tuple[Stage, ...] = ()
        self.reason = ""
        self.counted = 0  # what it adds to each of its stages' free_total
        self.seq = seq
        self.labels = labels
        self.timeout = timeout
        #: the ``Pools.token`` of the pools it is live in; None once removed
        self.owner: object = None
        self.expires_at = 0.0
        self.advertised = 0
        self.held = 0
        self.free = 0
        #: the routing index's own state for this worker (``indexes._Routed``), or None
        self.routing: Any = None
        #: the ids of its running requests, in dispatch order (ids, not the core's
        #: records, which must not be reachable from their worker; a list of at most
        #: its credits, fewer cache lines per dispatch and completion than a dict)
        self.running: list[str] = []

    @property
    def stage(self) -> Stage:
        """Its first stage, read from ``stages`` (one slot fewer per record; the
        decision rate measured the same either way)."""
        return self.stages[0]

    def __repr__(self) -> str:
        return (
            f"Worker({self.worker_id!r}, {'+'.join(self.stages)}, {self.state}, "
            f"held={self.held}/{self.advertised}, running={list(self.running)})"
        )


class Pools:
    """Live workers by id and by stage, their credits and heartbeat deadlines.
    ``index``: told of every change (see the module docstring), or ``None``."""

    def __init__(self, index: RoutingIndex | None = None) -> None:
        self.index = index
        self.workers: dict[str, Worker] = {}
        self.by_stage: dict[str, list[Worker]] = {s: [] for s in STAGES}
        self.free_total: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = 0
        self._spare: list[int] = []  # registration numbers made ahead (``_next_seq``)
        #: on each of its live workers (``Worker.owner``): membership in one read of a
        #: worker the caller holds, where a lookup by id in a fleet's table is a miss
        self.token = object()
        #: one dict per distinct label set, shared by its workers, and how many use it
        #: (an item's affinity hint is its producer's labels: one shared dict stays in
        #: the cache where a dict per worker of a fleet of thousands is a miss)
        self._labels: Interned[tuple[tuple[str, str], ...], dict[str, str]] = Interned()

    # ---- membership
    def add(
        self,
        worker_id: str,
        stages: tuple[Stage, ...],
        credits: int,
        labels: dict[str, str],
        timeout: float,
        now: float,
    ) -> Worker:
        """A new live, serving worker of ``stages`` (non-empty, no repeats); the id must
        not be live already (the core checks). ``labels`` may be shared with other
        workers from here on: nobody may change it."""
        seq = self._next_seq()
        key = tuple(sorted(labels.items()))
        labels = self._labels.hold(key, labels)
        w = Worker(worker_id, stages, seq, labels, timeout)
        w.owner = self.token
        self.workers[worker_id] = w
        for s in stages:
            self.by_stage[s].append(w)
        self.advertise(w, credits)
        self.touch(w, now)
        heapq.heappush(self._deadlines, (w.expires_at, w.seq, worker_id))
        return w

    def _next_seq(self) -> int:
        """The next registration number. Made 1,024 at a time, so the int objects lie
        side by side in memory: the indexes' heaps compare them, reading each one,
        and ints made one per registration among a worker's other objects were each
        a cache miss on a fleet of thousands."""
        if not self._spare:
            self._spare = list(range(self._seq + 1024, self._seq, -1))
        self._seq = self._spare.pop()
        return self._seq

    def remove(self, w: Worker) -> None:
        """Forget ``w`` and its credits. Its ``running`` items are the caller's to re-home."""
        del self.workers[w.worker_id]
        w.owner = None
        self._labels.drop(tuple(sorted(w.labels.items())))
        for s in w.stages:
            self.by_stage[s].remove(w)
            self.free_total[s] -= w.counted
        w.free = w.counted = 0
        if self.index is not None and w.state == "serving":
            self.index.remove(w)

    def set_state(self, w: Worker, state: WorkerState) -> None:
        """Move ``w`` to ``state``. Leaving ``serving`` takes its free credits out of
        ``free_total`` and it out of the routing index; running items stay held."""
        if state == w.state:
            return
        if w.state == "serving" and self.index is not None:
            self.index.remove(w)
        w.state = state
        self._refresh(w)

    # ---- liveness
    def touch(self, w: Worker, now: float) -> None:
        w.expires_at = now + w.timeout

    def expired(self, now: float) -> list[Worker] | tuple[()]:
        """Live workers whose deadline is at or before ``now``, oldest deadline first.

        They are still registered; the caller removes them. (Called at every event:
        with no deadline due, it allocates nothing.)
        """
        dl = self._deadlines
        if not dl or dl[0][0] > now:
            return ()
        out: list[Worker] = []
        while dl and dl[0][0] <= now:
            _, seq, wid = heapq.heappop(dl)
            w = self.workers.get(wid)
            if w is None or w.seq != seq:
                continue  # removed, or a later registration under the same id
            if w.expires_at <= now:
                out.append(w)
            else:
                heapq.heappush(dl, (w.expires_at, seq, wid))
        return out

    def next_deadline(self) -> float | None:
        """The earliest heartbeat deadline of any live worker, or ``None``."""
        dl = self._deadlines
        while dl:
            t, seq, wid = dl[0]
            w = self.workers.get(wid)
            if w is None or w.seq != seq:
                heapq.heappop(dl)
            elif w.expires_at != t:
                heapq.heapreplace(dl, (w.expires_at, seq, wid))
            else:
                return t
        return None

    # ---- credits
    def _refresh(self, w: Worker) -> None:
        free = w.advertised - w.held
        if free < 0:
            free = 0
        w.free = free
        if w.state != "serving":
            free = 0
        if free != w.counted:
            total = self.free_total
            for s in w.stages:
                total[s] += free - w.counted
            w.counted = free
        if self.index is not None and w.state == "serving":
            self.index.update(w)

    def advertise(self, w: Worker, credits: int) -> None:
        w.advertised = credits
        self._refresh(w)

    def hold(self, w: Worker) -> None:
        w.held += 1
        self._refresh(w)

    def release(self, w: Worker) -> None:
        w.held -= 1
        self._refresh(w)

    def candidates(self, stage: Stage) -> list[Worker]:
        """Serving workers of ``stage`` with a free credit, in registration order."""
        return [w for w in self.by_stage[stage] if w.counted]

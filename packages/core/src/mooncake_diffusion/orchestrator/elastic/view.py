"""What a planner reads, built from the core's snapshot and a window the driver keeps.

Both drivers (the service on wall time, the simulator in virtual time) use it
the same way; it reads no clock and starts nothing:

    window = PlanWindow(window=10.0)
    actions = core.handle(event)
    window.observe(now, event, actions)      # after every event the core took (or not)
    ...
    view = window.view(core.snapshot(), now) # every planner.interval
    decisions = planner.plan(view)

``observe`` records what the snapshot cannot show: submissions (the arrival
rate), finished requests and whether they met their deadline (attainment),
each stage's finished items and their dispatch-to-done seconds, and the target
of every accepted ``Reassign`` (so a worker on its way to a stage counts as
``incoming`` there until it serves again). ``view`` also samples how busy each
stage is; ``StageLoad.busy`` is the mean of those samples over the window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

from mooncake_diffusion.orchestrator.core.model import (
    STAGES,
    Action,
    CoreSnapshot,
    Dispatch,
    Event,
    ItemDone,
    Reassign,
    Rejected,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Stage,
    Submit,
    WorkerSnapshot,
)
from mooncake_diffusion.orchestrator.elastic.contract import PlannerView, StageLoad

__all__ = ["PlanWindow", "stages_of"]


def stages_of(w: WorkerSnapshot) -> tuple[Stage, ...]:
    """Every stage ``w`` holds (older snapshots list only ``stage``)."""
    return w.stages or (w.stage,)


def _accepted(event: Event, actions: Sequence[Action]) -> bool:
    name = type(event).__name__
    return not any(isinstance(a, Rejected) and a.event == name for a in actions)


class PlanWindow:
    """The driver's memory for planner views. ``window``: seconds each
    ``PlannerView.arrivals`` bucket spans (and the span of attainment, busy and
    service times); ``history``: how many arrival buckets a view carries at most
    (only whole buckets since the window was made, so a fresh window does not
    show a rise from zero). Not thread-safe: the driver's thread calls it."""

    def __init__(self, window: float = 10.0, history: int = 6, *, start: float | None = None):
        if not window > 0:
            raise ValueError(f"window must be > 0, got {window}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.window = window
        self.history = history
        self._start = start
        self._arrivals: deque[float] = deque()
        self._finished: deque[tuple[float, bool]] = deque()  # (t, met deadline)
        self._done: dict[Stage, deque[tuple[float, float]]] = {s: deque() for s in STAGES}
        self._dispatched: dict[tuple[str, Stage], float] = {}
        self._busy: deque[tuple[float, dict[Stage, float]]] = deque()
        #: worker -> the stages an accepted ``Reassign`` sent it to, until it serves again
        self.targets: dict[str, tuple[Stage, ...]] = {}

    # ------------------------------------------------------------------ recording
    def observe(self, now: float, event: Event, actions: Iterable[Action]) -> None:
        """Record one event the core handled and the actions it answered with."""
        actions = list(actions)
        if self._start is None:
            self._start = now
        accepted = _accepted(event, actions)
        if accepted and isinstance(event, Submit):
            self._arrivals.append(now)
        elif accepted and isinstance(event, ItemDone) and event.stage in self._done:
            stage: Stage = event.stage  # type: ignore[assignment]
            began = self._dispatched.pop((event.request_id, stage), now)
            self._done[stage].append((now, now - began))
        elif accepted and isinstance(event, Reassign):
            self.targets[event.worker_id] = tuple(event.stages)  # type: ignore[arg-type]
        for a in actions:
            if isinstance(a, Dispatch):
                self._dispatched[(a.item.request_id, a.item.stage)] = now
            elif isinstance(a, RequestCompleted):
                self._finished.append((now, a.deadline_met))
                self._forget(a.request_id)
            elif isinstance(a, RequestFailed):
                self._finished.append((now, False))
                self._forget(a.request_id)
            elif isinstance(a, RequestCancelled):
                self._forget(a.request_id)
        self._trim(now)

    def _forget(self, rid: str) -> None:
        for s in STAGES:
            self._dispatched.pop((rid, s), None)

    def _trim(self, now: float) -> None:
        horizon = now - self.window
        while self._arrivals and self._arrivals[0] <= now - self.window * self.history:
            self._arrivals.popleft()
        for q in (self._finished, self._busy, *self._done.values()):
            while q and q[0][0] <= horizon:
                q.popleft()

    # ------------------------------------------------------------------ the view
    def view(self, snap: CoreSnapshot, now: float | None = None) -> PlannerView:
        """The planner's view at ``now`` (default ``snap.now``: the time of the last
        event the core handled), and one busy sample taken there."""
        now = snap.now if now is None else now
        if self._start is None:
            self._start = now
        serving = [w for w in snap.workers if w.state == "serving"]
        live = {w.worker_id for w in snap.workers}
        for wid in [w for w in self.targets if w not in live]:
            del self.targets[wid]  # gone: it will not arrive
        for w in serving:
            self.targets.pop(w.worker_id, None)  # arrived (or never left)
        running = {s: 0 for s in STAGES}
        queued: dict[Stage, dict[str, int]] = {s: {} for s in STAGES}
        oldest: dict[Stage, float] = {}
        for r in snap.requests:
            if r.state == "running":
                running[r.stage] += 1
            else:
                queued[r.stage][r.slo_class] = queued[r.stage].get(r.slo_class, 0) + 1
                oldest[r.stage] = min(oldest.get(r.stage, math.inf), r.queued_since)
        holders = {s: [w for w in serving if s in stages_of(w)] for s in STAGES}
        credits = {s: sum(w.advertised for w in holders[s]) for s in STAGES}
        sample = {s: min(1.0, running[s] / credits[s]) if credits[s] else 0.0 for s in STAGES}
        self._busy.append((now, sample))
        self._trim(now)
        samples = [b for _, b in self._busy]
        loads: dict[Stage, StageLoad] = {}
        for s in STAGES:
            done = self._done[s]
            loads[s] = StageLoad(
                workers=len(holders[s]),
                incoming=sum(s in t for t in self.targets.values()),
                credits=credits[s],
                free=sum(w.free for w in holders[s]),
                queued=dict(sorted(queued[s].items())),
                oldest_wait=max(0.0, now - oldest[s]) if s in oldest else 0.0,
                busy=sum(b[s] for b in samples) / len(samples),
                done=len(done),
                service=(sum(d for _, d in done) / len(done)) if done else None,
            )
        return PlannerView(
            now=now,
            window=self.window,
            stages=loads,
            workers=snap.workers,
            arrivals=self._rates(now),
            attainment=self._attainment(),
        )

    def _rates(self, now: float) -> tuple[float, ...]:
        assert self._start is not None
        whole = min(self.history, int((now - self._start) / self.window + 1e-9))
        counts = [0] * whole
        for t in self._arrivals:
            k = math.ceil((now - t) / self.window - 1e-12) - 1  # 0: the latest bucket
            k = max(k, 0)
            if k < whole:
                counts[whole - 1 - k] += 1
        return tuple(c / self.window for c in counts)

    def _attainment(self) -> float | None:
        if not self._finished:
            return None
        return sum(met for _, met in self._finished) / len(self._finished)

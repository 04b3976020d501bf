"""A planner run by a driver: decisions become core events and provisioner calls.

The service's driver thread owns one (the core is not thread-safe, so this runs
there too); a simulator can drive it the same way in virtual time:

    el = Elastic(create_planner("reactive"), provisioner=None, window=10.0)
    acts = core.handle(ev); el.observe(now, ev, acts)    # after every event
    if el.due(now):                                       # every planner.interval
        el.step(core.snapshot(), now, feed)               # feed(event) -> actions

``step`` applies each decision: ``Move`` -> ``Reassign`` (the worker finishes or
yields what it holds, loads the new stages, registers again: a *stage change*,
recorded when that registration arrives), ``AddWorker`` -> ``provisioner.add``
(without a provisioner the decision is counted and dropped), ``Retire`` ->
``Drain``, then ``provisioner.remove`` once ``WorkerRemoved`` says the worker
left. ``counts`` tallies decisions by kind (``planner:move``, ``planner:add``,
``planner:retire``, ``planner:refused``); ``pending`` holds the planner's moves
under way and ``changes`` the last that landed (the service keeps its own record
of every stage change, the planner's or an operator's, with the load time).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable

import msgspec

from mooncake_diffusion.orchestrator.core.model import (
    STAGES,
    Action,
    CoreSnapshot,
    Drain,
    Event,
    Reassign,
    RegisterWorker,
    Rejected,
    Stage,
    WorkerRemoved,
)
from mooncake_diffusion.orchestrator.elastic.contract import (
    AddWorker,
    Decision,
    Move,
    Planner,
    Provisioner,
    Retire,
)
from mooncake_diffusion.orchestrator.elastic.view import PlanWindow, stages_of

__all__ = ["Elastic", "StageChange", "pool_sizes"]

log = logging.getLogger("mooncake_diffusion.orchestrator.elastic")  # its name before the move

#: finished stage changes kept for people
RECENT_CHANGES = 32


class StageChange(msgspec.Struct, frozen=True):
    """A worker moved from ``before`` to ``after``: asked at ``asked_at``, serving the
    new stages from ``done_at`` (``None`` while under way), driver-clock seconds."""

    worker_id: str
    before: tuple[Stage, ...]
    after: tuple[Stage, ...]
    reason: str
    asked_at: float
    done_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.asked_at

    def line(self) -> str:
        """One line for people: ``enc-0 encode -> denoise in 1.2 s (queued denoise 4, ...)``."""
        took = "" if self.seconds is None else f" in {self.seconds:.1f} s"
        was, now = "+".join(self.before), "+".join(self.after)
        return f"{self.worker_id} {was} -> {now}{took} ({self.reason})"


def pool_sizes(snap: CoreSnapshot) -> dict[Stage, int]:
    """Serving workers per stage (a worker holding several counts in each)."""
    out = dict.fromkeys(STAGES, 0)
    for w in snap.workers:
        if w.state == "serving":
            for s in stages_of(w):
                out[s] += 1
    return out


def _refused(event: Event, actions: Iterable[Action]) -> Rejected | None:
    name = type(event).__name__
    return next((a for a in actions if isinstance(a, Rejected) and a.event == name), None)


class Elastic:
    """See the module docstring. ``window``: seconds of history a view covers.
    ``on_change``: called with each finished ``StageChange`` (the driver's thread).
    Not thread-safe."""

    def __init__(
        self,
        planner: Planner,
        provisioner: Provisioner | None = None,
        *,
        window: float = 10.0,
        on_change: Callable[[StageChange], None] | None = None,
    ) -> None:
        self.planner = planner
        self.provisioner = provisioner
        self.window = PlanWindow(window=window)
        self.on_change = on_change
        self.counts: Counter[str] = Counter()
        self.changes: deque[StageChange] = deque(maxlen=RECENT_CHANGES)
        self.pending: dict[str, StageChange] = {}
        self.retiring: set[str] = set()
        self._next: float | None = None

    def observe(self, now: float, event: Event, actions: Iterable[Action]) -> None:
        """Record an event the core handled (every one, accepted or not) and its actions."""
        actions = list(actions)
        if self._next is None:
            self._next = now + self.planner.interval
        self.window.observe(now, event, actions)
        if isinstance(event, RegisterWorker) and _refused(event, actions) is None:
            moving = self.pending.pop(event.worker_id, None)
            if moving is not None:
                done = msgspec.structs.replace(moving, done_at=now)
                self.changes.append(done)
                log.info("orchestrator: stage change: %s", done.line())
                if self.on_change is not None:
                    self.on_change(done)
        for a in actions:
            if isinstance(a, WorkerRemoved):
                self.pending.pop(a.worker_id, None)  # gone mid-change: it will not arrive
                if a.worker_id in self.retiring:
                    self.retiring.discard(a.worker_id)
                    self._remove(a.worker_id)

    def use(self, planner: Planner, provisioner: Provisioner | None, now: float) -> None:
        """Switch to ``planner`` (and ``provisioner``, unless ``None``); its first call is
        one interval from ``now``. Moves under way are still recorded when they land."""
        self.planner = planner
        if provisioner is not None:
            self.provisioner = provisioner
        self._next = now + planner.interval

    def due(self, now: float) -> bool:
        """Whether ``step`` should run now (every ``planner.interval`` from the first
        event; never for a planner that ``changes_nothing``)."""
        return self._next is not None and now >= self._next and not self._idle()

    def next_at(self) -> float | None:
        """When ``step`` is due next (``None`` until the first event, and for a planner
        that ``changes_nothing``)."""
        return None if self._idle() else self._next

    def _idle(self) -> bool:
        return getattr(self.planner, "changes_nothing", False) is True

    def step(
        self, snap: CoreSnapshot, now: float, feed: Callable[[Event], list[Action]]
    ) -> list[Decision]:
        """Ask the planner and apply what it decides; ``feed`` runs one event through
        the core (and executes its actions) and returns them. Returns the decisions."""
        self._next = now + self.planner.interval
        decisions = self.planner.plan(self.window.view(snap, now))
        workers = {w.worker_id: w for w in snap.workers}
        for d in decisions:
            if isinstance(d, Move):
                self.counts["planner:move"] += 1
                ev: Event = Reassign(d.worker_id, d.stages, d.reason)
                if self._fed(ev, feed) and d.worker_id in workers:
                    before = stages_of(workers[d.worker_id])
                    change = StageChange(d.worker_id, before, d.stages, d.reason, now)
                    self.pending[d.worker_id] = change
            elif isinstance(d, AddWorker):
                self.counts["planner:add"] += 1
                self._add(d)
            elif isinstance(d, Retire):
                self.counts["planner:retire"] += 1
                self.retiring.add(d.worker_id)  # before: an idle worker is removed at once
                if not self._fed(Drain(d.worker_id, d.reason), feed):
                    self.retiring.discard(d.worker_id)
        return decisions

    def _fed(self, ev: Event, feed: Callable[[Event], list[Action]]) -> bool:
        refused = _refused(ev, feed(ev))
        if refused is not None:
            self.counts["planner:refused"] += 1
            log.warning("orchestrator: planner's %s refused: %s", type(ev).__name__, refused.reason)
        return refused is None

    def _add(self, d: AddWorker) -> None:
        if self.provisioner is None:
            log.info("orchestrator: planner wants a %s worker; no provisioner", "+".join(d.stages))
            return
        try:
            wid = self.provisioner.add(d.stages)
        except Exception:
            self.counts["provisioner:errors"] += 1
            log.exception("orchestrator: provisioner.add(%s) failed", d.stages)
            return
        log.info("orchestrator: added worker %s for %s (%s)", wid, "+".join(d.stages), d.reason)

    def _remove(self, wid: str) -> None:
        if self.provisioner is None:
            return
        try:
            self.provisioner.remove(wid)
        except Exception:
            self.counts["provisioner:errors"] += 1
            log.exception("orchestrator: provisioner.remove(%s) failed", wid)

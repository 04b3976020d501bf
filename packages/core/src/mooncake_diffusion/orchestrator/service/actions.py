"""What an event does outside the core: the core handles it, the service executes its actions.

``ActionsMixin`` is a base of ``OrchestratorService`` (``service.py``), not a class
to use alone: an action touches the service's state all over (the request table,
counters and metrics, the stage-change and drain bookkeeping, the Work still owed,
the releases) and reaches workers through the channel (``channel.py``). The calls:

    _feed(event, ident)        every event: API calls (``service.py``), worker frames
                               (``channel.py``), a ``Tick`` (``driver.py``); the core
                               handles it, the planner's window sees it, then
      _execute(action, ident)  each action: the table, counters, frames to workers,
                               releases; a refusal of a worker's event is ``Refused``
    _replayed(event, actions)  journal recovery (``JournaledOrchestrator.recover``'s
                               observer, from ``service._open_core``): the same
                               bookkeeping, nothing sent
    _plan()                    the planner's round (``driver._turn_rest`` when it is
      _planner_feed(event)     due, ``plan_now``): its events fed like any other

All of it runs on the driver's thread, inside a turn (``driver._turn``): frames wait
for the turn's commit, so nothing here blocks. ``_feed`` raises ``RequestRejected``
for an API event (``ident`` None) the core refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Dispatch,
    Drain,
    Event,
    ItemDone,
    LoadStages,
    Preempt,
    RegisterWorker,
    Rejected,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Rerun,
    Revoke,
    Submit,
    WorkerRemoved,
)
from mooncake_diffusion.orchestrator.elastic.contract import Decision
from mooncake_diffusion.orchestrator.link.wire import (
    Drop,
    ItemRef,
    Load,
    Refused,
    Retire,
    Yield,
)
from mooncake_diffusion.orchestrator.service.driver import RequestRejected

__all__ = ["ActionsMixin"]

log = logging.getLogger("mooncake_diffusion.orchestrator")


class ActionsMixin:
    """Events through the core and their actions executed, as methods of
    ``OrchestratorService`` (module docstring). It reads and writes the service's
    ``_core``, ``_elastic``, ``table``, ``metrics``, ``_counters``, ``_loading``,
    ``_before``, ``_draining``, ``_memory``, the Work owed (``_sent``) and the
    releases (``_releases``); it sends through the channel's ``_send`` and
    ``_send_work``."""

    def _feed(
        self, event: Event, ident: bytes | None, accepted: Callable[[], None] | None = None
    ) -> list[Action]:
        """Run one event through the core and execute its actions. An API event that
        is rejected raises ``RequestRejected``; a worker's gets ``Refused``.
        ``accepted`` runs only if the core took the event, before its actions run (so
        a client sees a stage done before the dispatch or completion that follows)."""
        assert self._core is not None
        actions = self._core.handle(event)
        self._elastic.observe(self._now(), event, actions)
        name = type(event).__name__
        rejected = next((a for a in actions if isinstance(a, Rejected) and a.event == name), None)
        if rejected is None and isinstance(event, Submit):
            self._counters["submitted"] += 1
            self._table_submitted(event)
        if rejected is None and accepted is not None:
            accepted()
        if rejected is None and isinstance(event, Drain):
            self._draining.add(event.worker_id)
        for a in actions:
            self._execute(a, ident)
        if rejected is not None and ident is None:
            raise RequestRejected(rejected.code, rejected.reason)
        return actions

    # ------------------------------------------------------------------ the planner
    def _plan(self) -> list[Decision]:
        assert self._core is not None
        return self._elastic.step(self._core.snapshot(), self._now(), self._planner_feed)

    def _planner_feed(self, ev: Event) -> list[Action]:
        try:
            return self._feed(ev, None)
        except RequestRejected as e:  # the actions ran; only the refusal matters here
            return [Rejected(e.code, e.reason, type(ev).__name__)]  # type: ignore[arg-type]

    # ------------------------------------------------------------------ actions
    def _table_submitted(self, ev: Submit) -> None:
        self.table.submitted(ev.request_id, ev.slo_class or self.config.orchestrator.default_class)

    def _replayed(self, event: Event, actions: list[Action]) -> None:
        """Journal recovery: rebuild statuses and who produced what (nothing is sent)."""
        if isinstance(event, Submit) and not any(isinstance(a, Rejected) for a in actions):
            self._table_submitted(event)
        if isinstance(event, ItemDone) and event.output:
            self._releases.produced(event.request_id, event.worker_id)
        if isinstance(event, RegisterWorker):
            self._loading.pop(event.worker_id, None)
        elif isinstance(event, Drain) and not any(isinstance(a, Rejected) for a in actions):
            self._draining.add(event.worker_id)
        for a in actions:
            if isinstance(a, LoadStages):
                self._loading[a.worker_id] = (a.stages, a.reason, time.monotonic())
            elif isinstance(a, WorkerRemoved):
                self._loading.pop(a.worker_id, None)
                self._draining.discard(a.worker_id)
            self.table.apply(a)
            self._releases.resumable_of(a)
            if isinstance(a, ReleasePayloads):
                self._releases.replayed_release(a.request_id)

    def _execute(self, a: Action, ident: bytes | None) -> None:
        self.table.apply(a)
        resumable = self._releases.resumable_of(a)
        if resumable is not None:
            wid, item = resumable
            self._releases.forget_resumable(wid, item, self._core)
        if isinstance(a, Dispatch):
            self._counters[f"dispatched:{a.item.stage}"] += 1
            self._observe_dispatch(a.item.request_id, a.item.stage)
            self._send_work(a)
        elif isinstance(a, Revoke):
            ref = ItemRef(a.request_id, a.stage, a.attempt)
            self._sent.forget(ref)
            self._send(a.worker_id.encode(), Drop(ref, a.reason))
        elif isinstance(a, Preempt):
            ref = ItemRef(a.request_id, a.stage, a.attempt)
            self._counters["preemptions"] += 1
            self.table.preempted(ref, a.worker_id, a.reason)
            self._send(a.worker_id.encode(), Yield(ref, a.reason))
        elif isinstance(a, Requeued):
            self._counters[f"requeued:{a.stage}"] += 1
            self._sent.forget(ItemRef(a.request_id, a.stage, a.attempt))
        elif isinstance(a, Rerun):
            self._counters[f"rerun:{a.stage}"] += 1
            log.warning("orchestrator: %s: %s runs again: %s", a.request_id, a.stage, a.reason)
        elif isinstance(a, ReleasePayloads):
            self._releases.release(a.request_id, self._core)
        elif isinstance(a, RequestCompleted):
            self._counters["completed"] += 1
            self.metrics.request_seconds.observe(a.finished_at - a.submitted_at)
        elif isinstance(a, RequestFailed):
            self._counters["failed"] += 1
        elif isinstance(a, RequestCancelled):
            self._counters["cancelled"] += 1
        elif isinstance(a, LoadStages):
            self._counters["stage_changes"] += 1
            self._loading[a.worker_id] = (a.stages, a.reason, time.monotonic())
            assert self._core is not None  # rare: a snapshot is cheap enough here
            held = (w for w in self._core.snapshot().workers if w.worker_id == a.worker_id)
            self._before[a.worker_id] = next((w.stages for w in held), ())
            log.warning(
                "orchestrator: stage change: worker %s loads %s (%s)",
                a.worker_id,
                "+".join(a.stages),
                a.reason,
            )
            self._send(a.worker_id.encode(), Load(a.stages, a.reason))
        elif isinstance(a, WorkerRemoved):
            self._sent.forget_worker(a.worker_id)  # re-queued or failed: nothing to resend
            self._loading.pop(a.worker_id, None)
            self._memory.pop(a.worker_id, None)
            self._before.pop(a.worker_id, None)
            self._counters["workers_removed"] += 1
            if a.worker_id in self._draining:  # drained: it holds nothing and may exit
                self._draining.discard(a.worker_id)
                self._counters["drained"] += 1
                self._send(a.worker_id.encode(), Retire(a.reason))
                log.warning("orchestrator: worker %s drained: %s", a.worker_id, a.reason)
            else:
                log.warning("orchestrator: worker %s removed: %s", a.worker_id, a.reason)
        elif isinstance(a, Rejected):
            self._counters[f"rejected:{a.code}"] += 1
            log.info("orchestrator: rejected %s: %s", a.event, a.reason)
            if ident is not None:
                self._send(ident, Refused(a.code, a.reason, a.event))

    # ------------------------------------------------------------------ histograms
    def _observe_dispatch(self, rid: str, stage: str) -> None:
        """Queue wait: from the request's previous event (submitted, the previous
        stage's done, requeued or yielded) to this dispatch."""
        st = self.table.status(rid)
        if st is not None and len(st.events) >= 2 and st.events[-1].kind == "dispatched":
            wait = st.events[-1].t - st.events[-2].t
            self.metrics.queue_wait.labels(stage=stage).observe(max(0.0, wait))

    def _observe_done(self, rid: str, stage: str, info: Any) -> None:
        st = self.table.status(rid)
        if st is None:
            return
        run_s = sent = None
        for ev in reversed(st.events):
            if run_s is None and ev.kind == "dispatched" and ev.stage == stage:
                run_s = st.events[-1].t - ev.t
            elif sent is None and ev.kind == "done" and ev.stage != stage:
                sent = ev.info.get("bytes")
        self.metrics.stage_done(stage, run_s, info, sent if isinstance(sent, int) else 0)

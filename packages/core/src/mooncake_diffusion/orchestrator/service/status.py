"""What a client sees of its requests: statuses and event streams, built from the core's actions.

``RequestTable`` lives in the service's driver thread (not thread-safe). The
driver tells it what happened, in order:

    table.submitted(rid, slo_class)              after the core accepted a Submit
    table.apply(action)                          for every action the core returned
    table.done(ref, worker_id, info)             a worker's accepted Done (its info)
    table.progress(ref, worker_id, step, total)  a worker's Progress (not journaled)
    table.status(rid) / table.subscribe(rid, q)  for the API

Every change becomes a ``RequestEvent`` appended to the request's history and
put on each subscriber's queue; the terminal event is followed by ``None`` (end
of stream). Finished requests are remembered up to ``max_finished`` (oldest
forgotten first). Times are wall-clock (``time.time()``) seconds, for people.
"""

from __future__ import annotations

import queue
import time
from collections import OrderedDict
from typing import Literal

import msgspec

from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Dispatch,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Rerun,
)
from mooncake_diffusion.orchestrator.link.wire import Info, ItemRef

__all__ = ["TERMINAL", "RequestEvent", "RequestStatus", "RequestTable"]

State = Literal["queued", "running", "completed", "failed", "cancelled"]
TERMINAL = frozenset({"completed", "failed", "cancelled"})
#: History kept per request (progress events are streamed but never stored).
MAX_EVENTS = 256


class RequestEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """One thing that happened to a request. ``kind``: submitted, dispatched, progress,
    done (a stage's output is published; ``info`` from the worker), requeued, rerun
    (an output was lost: ``stage`` made it and runs again),
    preempted (asked to yield), yielded (back in its queue), completed, failed,
    cancelled."""

    request_id: str
    kind: str
    t: float
    stage: str | None = None
    attempt: int | None = None
    worker_id: str | None = None
    step: int | None = None
    total: int | None = None
    reason: str | None = None
    info: Info = msgspec.field(default_factory=dict)


class RequestStatus(msgspec.Struct, omit_defaults=True):
    """A request as the API returns it. ``output``: the last stage's output handle
    (completed only). ``deadline_met``: against its SLO class deadline."""

    request_id: str
    state: State
    slo_class: str
    submitted_at: float
    stage: str | None = None
    attempt: int | None = None
    worker_id: str | None = None
    step: int | None = None
    total: int | None = None
    finished_at: float | None = None
    deadline_met: bool | None = None
    output: bytes | None = None
    reasons: list[str] = msgspec.field(default_factory=list)
    events: list[RequestEvent] = msgspec.field(default_factory=list)


_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder(RequestStatus).decode

Subscriber = "queue.SimpleQueue[RequestEvent | None]"


class RequestTable:
    def __init__(self, max_finished: int = 10_000) -> None:
        self.max_finished = max_finished
        self._live: dict[str, RequestStatus] = {}
        # finished statuses, encoded: bytes are nothing the garbage collector walks
        # (10,000 statuses with their events were most of what a full collection
        # walked in a busy service); decoded afresh at each read
        self._finished: OrderedDict[str, bytes] = OrderedDict()
        self._subs: dict[str, list[queue.SimpleQueue[RequestEvent | None]]] = {}
        #: while held (``hold``): stream items not yet put, in order
        self._held: list[tuple[queue.SimpleQueue[RequestEvent | None], RequestEvent | None]] = []
        self._holding = False

    # ------------------------------------------------------------------ reads
    def status(self, rid: str) -> RequestStatus | None:
        """The request's status: the live one itself, or a finished one's copy."""
        st = self._live.get(rid)
        if st is not None:
            return st
        blob = self._finished.get(rid)
        return None if blob is None else _unpack(blob)

    def status_copy(self, rid: str) -> RequestStatus | None:
        """The request's status as a copy its reader may keep while the table goes on
        changing (the live one's lists copied; a finished one is decoded afresh)."""
        st = self._live.get(rid)
        if st is not None:
            return msgspec.structs.replace(st, events=list(st.events), reasons=list(st.reasons))
        return self.status(rid)

    def live(self) -> list[RequestStatus]:
        return list(self._live.values())

    def recent(self, n: int) -> list[RequestStatus]:
        """The last ``n`` finished requests, oldest first."""
        out = []
        for rid in reversed(self._finished):
            if len(out) == n:
                break
            out.append(_unpack(self._finished[rid]))
        return out[::-1]

    def subscribe(self, rid: str, q: queue.SimpleQueue[RequestEvent | None]) -> bool:
        """Replay the history into ``q`` and follow; False if ``rid`` is unknown."""
        st = self.status(rid)
        if st is None:
            return False
        for ev in st.events:
            q.put(ev)
        if st.state in TERMINAL:
            q.put(None)
        else:
            self._subs.setdefault(rid, []).append(q)
        return True

    def unsubscribe(self, rid: str, q: queue.SimpleQueue[RequestEvent | None]) -> None:
        """Stop following into ``q`` (a stream that ended before its request did);
        nothing if the request already finished (its queues went with it)."""
        subs = self._subs.get(rid)
        if subs is None:
            return
        kept = [s for s in subs if s is not q]
        if kept:
            self._subs[rid] = kept
        else:
            del self._subs[rid]

    def hold(self) -> None:
        """Keep new stream items back until ``release`` (the service's group commit:
        no client sees an event before it is durable). Statuses change at once."""
        self._holding = True

    def release(self, deliver: bool = True) -> None:
        """Put the held stream items (or, ``deliver=False``, drop them), stop holding."""
        held, self._held, self._holding = self._held, [], False
        if deliver:
            for q, ev in held:
                q.put(ev)

    def _put(self, q: queue.SimpleQueue[RequestEvent | None], ev: RequestEvent | None) -> None:
        if self._holding:
            self._held.append((q, ev))
        else:
            q.put(ev)

    def close_streams(self) -> None:
        for subs in self._subs.values():
            for q in subs:
                q.put(None)
        self._subs.clear()

    # ------------------------------------------------------------------ writes
    def submitted(self, rid: str, slo_class: str) -> None:
        now = time.time()
        self._live[rid] = RequestStatus(rid, "queued", slo_class, now)
        self._emit(rid, RequestEvent(rid, "submitted", now))

    def apply(self, action: Action) -> None:
        if isinstance(action, Dispatch):
            it = action.item
            st = self._live.get(it.request_id)
            if st is not None:
                st.state, st.stage, st.attempt = "running", it.stage, it.attempt
                st.worker_id, st.step, st.total = action.worker_id, None, None
                ev = RequestEvent(it.request_id, "dispatched", time.time(), it.stage, it.attempt)
                self._emit(it.request_id, msgspec.structs.replace(ev, worker_id=action.worker_id))
        elif isinstance(action, Requeued | Rerun):
            st = self._live.get(action.request_id)
            if st is not None:
                st.state, st.worker_id = "queued", None
                st.reasons.append(action.reason)
                requeued = isinstance(action, Requeued)
                ev = RequestEvent(
                    action.request_id,
                    "requeued" if requeued else "rerun",
                    time.time(),
                    action.stage,
                    action.attempt if isinstance(action, Requeued) else None,
                    reason=action.reason,
                )
                self._emit(action.request_id, ev)
        elif isinstance(action, RequestCompleted):
            self._finish(
                action.request_id,
                "completed",
                output=action.output,
                deadline_met=action.deadline_met,
            )
        elif isinstance(action, RequestFailed):
            self._finish(action.request_id, "failed", reasons=list(action.reasons))
        elif isinstance(action, RequestCancelled):
            self._finish(action.request_id, "cancelled", reasons=[action.reason])

    def done(self, ref: ItemRef, worker_id: str, info: Info) -> None:
        st = self._live.get(ref.request_id)
        if st is not None:
            st.state, st.worker_id = "queued", None  # for the next stage (or completion)
            ev = RequestEvent(
                ref.request_id, "done", time.time(), ref.stage, ref.attempt, worker_id, info=info
            )
            self._emit(ref.request_id, ev)

    def preempted(self, ref: ItemRef, worker_id: str, reason: str) -> None:
        """A ``Preempt`` was sent (the item still runs until it yields)."""
        if ref.request_id in self._live:
            ev = RequestEvent(
                ref.request_id, "preempted", time.time(), ref.stage, ref.attempt, worker_id
            )
            self._emit(ref.request_id, msgspec.structs.replace(ev, reason=reason))

    def yielded(self, ref: ItemRef, worker_id: str) -> None:
        """The worker stopped the item; the request waits in its queue again."""
        st = self._live.get(ref.request_id)
        if st is not None:
            st.state, st.worker_id = "queued", None
            ev = RequestEvent(
                ref.request_id, "yielded", time.time(), ref.stage, ref.attempt, worker_id
            )
            self._emit(ref.request_id, ev)

    def progress(self, ref: ItemRef, worker_id: str, step: int, total: int) -> None:
        st = self._live.get(ref.request_id)
        if st is None or (st.stage, st.attempt) != (ref.stage, ref.attempt):
            return
        st.step, st.total = step, total
        ev = RequestEvent(
            ref.request_id, "progress", time.time(), ref.stage, ref.attempt, worker_id, step, total
        )
        for q in self._subs.get(ref.request_id, ()):
            self._put(q, ev)

    # ------------------------------------------------------------------ internals
    def _finish(
        self,
        rid: str,
        state: State,
        *,
        output: bytes | None = None,
        reasons: list[str] = (),
        deadline_met: bool | None = None,
    ) -> None:
        st = self._live.pop(rid, None)
        if st is None:
            return
        now = time.time()
        st.state, st.finished_at, st.worker_id = state, now, None
        st.output, st.deadline_met = output, deadline_met
        if state == "failed":  # the core's: every failed attempt, those requeued included
            st.reasons = list(reasons)
        elif state != "completed":
            st.reasons.extend(reasons)
        ev = RequestEvent(rid, state, now, st.stage, st.attempt, reason="; ".join(reasons) or None)
        self._emit(rid, ev, st)
        for q in self._subs.pop(rid, ()):
            self._put(q, None)
        self._finished[rid] = _pack(st)
        while len(self._finished) > self.max_finished:
            self._finished.popitem(last=False)

    def _emit(self, rid: str, ev: RequestEvent, st: RequestStatus | None = None) -> None:
        st = st or self._live.get(rid)
        if st is not None and len(st.events) < MAX_EVENTS:
            st.events.append(ev)
        for q in self._subs.get(rid, ()):
            self._put(q, ev)

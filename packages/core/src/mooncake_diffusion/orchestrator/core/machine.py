"""The orchestrator core: a deterministic state machine, events in, actions out.

    core = Orchestrator(OrchestratorConfig(), clock=VirtualClock())
    core.handle(RegisterWorker("dec-0", "decode", credits=2, labels={"node": "n0"}))
    actions = core.handle(Submit("r1", slo_class="interactive", params=b"..."))
    for a in actions:                       # the driver executes every action, in order:
        ...                                 #   Dispatch -> send a.item to a.worker_id
    core.handle(ItemDone("enc-0", "r1", "encode", 1, output=embedding_handle))
    core.next_deadline()                    # call handle(Tick()) then if nothing else came
    core.snapshot()                         # metrics, invariant checks

Every ``handle`` call reads the time once (the injected clock, or ``now=``),
declares dead the workers past their heartbeat deadline (their items go back
to their queues), applies the event, then dispatches while credits allow,
downstream stage first. Nothing else: no threads, sockets or clock reads, so a
service and a simulator run this same code and a run replays from its events.
Not thread-safe: one driver thread calls it.

Rules:
- A request runs Encode -> Denoise -> Decode; ``Submit.cached_embeddings``
  skips Encode. One stage of a request is active at a time.
- Encode and Decode are work queues: any worker of the pool takes any item.
  Denoise has an admission queue: a job is dispatched once, to one worker (a
  group, by its leader), and stays there until it is done; never per step.
- Queue order is ``queues.ClassQueue``: priority between SLO classes, FIFO
  within one, and a bounded wait for classes with ``max_wait``.
- Workers: a worker holds one or more stages (``RegisterWorker.stages``) and
  one set of credits shared by them (one GPU); it is a candidate of each of its
  stages. A fleet in which every worker holds every stage is colocated serving.
- Credits: a dispatch holds one credit of its worker until the item is done,
  failed, revoked or its worker is gone. A denoise job is admitted only when
  a decode credit can be reserved for its latent: free decode credits (serving
  workers) must exceed the reservations already made. The reservation lives
  while the job runs and while its decode item waits, and becomes a held
  decode credit at dispatch. A job running on a worker that also holds decode
  reserves nothing while it runs: the credit it holds becomes a free decode
  credit when it ends (its own latent's), and taking that credit left at least
  as many free decode credits as reservations. So a slow decode pool stops
  denoise admission before latents pile up. (A decode worker lost, shrunk,
  changing stage or lending its credit to an encode item can leave more
  reservations than free credits; admission then waits until that recovers.)
- Stage changes (``Reassign``) and scale-down (``Drain``): the worker stops
  serving at once (``changing`` / ``draining``: nothing more is dispatched to
  it), each of its running denoise jobs gets one ``Preempt`` (whatever
  ``config.preemption`` says, not counted against ``max_preemptions``), and its
  encode and decode items finish or come back with ``ItemYielded`` (accepted
  for any item of such a worker; not a failed attempt, the item is queued again
  keeping its place). When it holds nothing: a changing worker gets
  ``LoadStages`` (state ``loading``; heartbeats keep it live) and its next
  ``RegisterWorker`` under the same id replaces it, serving the new stages; a
  draining worker is removed (``WorkerRemoved`` with the drain's reason). A
  worker lost or silent in any of these states is handled as any other.
- Affinity: each item carries the labels of the worker that produced its input
  (``WorkItem.hint``); the routing policy may prefer workers that match.
- Failures: a worker silent for longer than its heartbeat timeout, or reported
  lost, is removed; its items are re-queued keeping their input handles (at
  least once). A result counts only from the worker holding the current
  attempt of that (request, stage); anything else is ``Rejected`` and dropped.
  After ``max_attempts`` dispatches of a stage, or a non-retryable failure,
  the request fails with one reason per failed attempt.
- Lost inputs: a failure that says its input is gone (``ItemFailed.input_lost``,
  e.g. the store host died with the embeddings) sends the request back to the
  stage that produced that input (``Rerun``), at most ``max_reruns`` times per
  request and only while both stages have attempts left; otherwise (or at the
  first stage) it is an ordinary failure. Attempt numbers of a stage keep
  growing across reruns, so a result of an attempt from before the rerun is
  stale, and every attempt counts against ``max_attempts``. The lost handle is
  kept for the final ``ReleasePayloads``.
- Preemption (``OrchestratorConfig.preemption``): when denoise jobs of a
  higher-priority class wait and no denoise credit is free, the most recently
  started running job of the lowest class below them gets one ``Preempt``
  (one per waiting job); its worker stops at a step boundary and answers
  ``ItemYielded``, the job goes back to the queue keeping its place (its
  progress is in the step-checkpoint cache), and the freed credit admits the
  waiting job. A yield is not a failed attempt; a request is preempted at most
  ``max_preemptions`` times, so it cannot starve.
- Every request ends with exactly one of RequestCompleted / RequestFailed /
  RequestCancelled followed by one ReleasePayloads; its credits and
  reservation are released at that moment.
- Bad events are answered with ``Rejected`` and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import msgspec

from mooncake_diffusion.orchestrator.core.clock import Clock
from mooncake_diffusion.orchestrator.core.indexes import RoutingIndex
from mooncake_diffusion.orchestrator.core.model import (
    MAX_HANDLE_BYTES,
    MAX_ID,
    MAX_LABELS,
    STAGES,
    Action,
    Cancel,
    CoreSnapshot,
    Dispatch,
    Drain,
    Event,
    Heartbeat,
    ItemDone,
    ItemFailed,
    ItemYielded,
    LoadStages,
    OrchestratorConfig,
    Preempt,
    Reassign,
    RegisterWorker,
    RejectCode,
    Rejected,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RequestSnapshot,
    Requeued,
    Rerun,
    Revoke,
    SloClass,
    Stage,
    Submit,
    Tick,
    WorkerLost,
    WorkerRemoved,
    WorkerSnapshot,
    WorkerState,
    WorkItem,
)
from mooncake_diffusion.orchestrator.core.pools import Pools, Worker
from mooncake_diffusion.orchestrator.core.queues import ClassQueue
from mooncake_diffusion.orchestrator.core.registry import create_policy
from mooncake_diffusion.orchestrator.core.routing import RoutingPolicy
from mooncake_diffusion.orchestrator.core.victims import Victims
from mooncake_diffusion.orchestrator.errors import ClockError, PolicyContractError

__all__ = ["Orchestrator"]

_FULL: tuple[Stage, ...] = ("encode", "denoise", "decode")
_CACHED: tuple[Stage, ...] = ("denoise", "decode")
_PUMP_ORDER: tuple[Stage, ...] = ("decode", "denoise", "encode")  # downstream first
MAX_REASON = 1024
#: the hint of an item whose input no worker produced: one dict for every request (a
#: hint is read, never changed, as the workers' label dicts it is otherwise one of)
_NO_HINT: dict[str, str] = {}


def _ok_id(x: object) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_ID


class _Request(msgspec.Struct, gc=False):
    """A live request. ``attempt`` counts dispatches of the current stage; ``token``
    is its queue token (0: not queued); ``worker`` is set while it runs.

    Not tracked by the garbage collector (``gc=False``): a fleet keeps thousands of
    requests live, and each full collection walked every one of them, at 4,096
    workers tens of milliseconds at a time. That is sound only while no reference
    cycle runs through a record: nothing a record refers to may refer back to it
    (a worker's ``running`` holds request ids, not records; the indexes, queues and
    ``Victims`` refer to records, and no record refers to them).

    Small: a fleet's thousands of live records are read a dispatch apart, each one
    out of the CPU's cache, so a record makes no object it does not need. ``hint``
    starts as the shared ``_NO_HINT``, and ``yielded`` and ``tried`` stay ``None``
    until a yield, a retry or a rerun needs them.
    """

    # the fields a dispatch and a completion read come first, the rest after them: a
    # record's hot part spans fewer cache lines
    rid: str
    cls: SloClass
    params: bytes
    deadline: float
    stages: tuple[Stage, ...]
    input: bytes
    hint: dict[str, str]  # the labels of the worker that made ``input`` (or _NO_HINT)
    since: float
    started: float  # when the running denoise attempt was dispatched (preemption on only)
    index: int = 0
    attempt: int = 0
    worker: Worker | None = None
    token: int = 0
    reserved: bool = False
    preempting: bool = False  # a Preempt was sent for the running attempt
    #: the outputs of the stages done before the one that made ``input``: its outputs so
    #: far are these and ``input`` (none while ``index`` is 0). A stage done writes a
    #: tuple only from the second on, so a record makes fewer objects, each of them
    #: read again a stage later out of the CPU's cache (a tuple, not a list: it leaves
    #: the garbage collector's books at its first pass)
    prior: tuple[bytes, ...] = ()
    #: highest attempt dispatched per stage it has left (the current one's is
    #: ``attempt``), written when it leaves a stage (not at every dispatch) where that
    #: is not 1 (``left_attempts``), and always for the stage a rerun went back from
    #: (None: nothing written yet)
    tried: dict[str, int] | None = None
    submitted_at: float = 0.0
    first_input: bytes = b""
    reasons: tuple[str, ...] = ()
    lost: tuple[bytes, ...] = ()  # handles of outputs lost (released at the end)
    yields: int = 0  # priority preemptions that ended in ItemYielded (max_preemptions)
    #: per stage, dispatches that ended in ItemYielded (any cause): not failed attempts
    #: (None: none yet)
    yielded: dict[str, int] | None = None
    reruns: int = 0  # Rerun actions taken for this request

    @property
    def stage(self) -> Stage:
        return self.stages[self.index]

    @property
    def spent(self) -> int:
        """Dispatches of the current stage that count against ``max_attempts``."""
        return self.attempt - self.yielded_at(self.stages[self.index])

    def yielded_at(self, stage: str) -> int:
        """Dispatches of ``stage`` that ended in ``ItemYielded``."""
        return self.yielded.get(stage, 0) if self.yielded else 0

    def left_attempts(self, stage: str) -> int:
        """The highest attempt of ``stage``, a stage it has left (so dispatched at
        least once): 1 unless ``tried`` says otherwise."""
        return self.tried.get(stage, 1) if self.tried else 1

    def remember(self, stage: str, attempt: int) -> None:
        """Write ``stage``'s highest attempt in ``tried``."""
        if self.tried is None:
            self.tried = {}
        self.tried[stage] = attempt


class Orchestrator:
    """The deterministic scheduling core (see the module docstring for the rules).

    ``clock``: where ``handle`` reads the time when no ``now=`` is passed; with
    neither, ``handle`` raises ``ClockError``. ``policy``: any ``RoutingPolicy``;
    default ``create_policy(config.policy)``.
    """

    def __init__(
        self,
        config: OrchestratorConfig | None = None,
        *,
        clock: Clock | None = None,
        policy: RoutingPolicy | None = None,
    ) -> None:
        self.config = config if config is not None else OrchestratorConfig()
        self.policy: RoutingPolicy = (
            policy if policy is not None else create_policy(self.config.policy)
        )
        self._clock = clock
        self._now = float("-inf")
        self._classes = {c.name: c for c in self.config.classes}
        make_index = getattr(self.policy, "index", None)
        #: the policy's routing index (``indexes.py``), or None: choose() over candidates
        self._index: RoutingIndex | None = make_index() if callable(make_index) else None
        self._pools = Pools(self._index)
        self._queues: dict[Stage, ClassQueue[_Request]] = {
            s: ClassQueue(self.config.classes) for s in STAGES
        }
        self._requests: dict[str, _Request] = {}
        #: finished request id -> outcome, the last ``finished_memory`` of them; and
        #: their ids by finishing number, to forget the oldest. Plain dicts of str and
        #: int, which the garbage collector does not track: an ``OrderedDict`` is walked
        #: at every full collection, 65,536 ids by default
        self._finished: dict[str, str] = {}
        self._finished_ids: dict[int, str] = {}
        self._finished_n = 0
        self._decode_reserved = 0
        #: running denoise jobs for the preemption rule (None: preemption is off)
        self._victims = Victims(self.config.max_preemptions) if self.config.preemption else None
        #: workers that stopped serving and may hold nothing now: settled after the event
        self._settle: list[Worker] = []
        self._handlers: dict[type, Callable[[Any, float, list[Action]], None]] = {
            Submit: self._on_submit,
            Cancel: self._on_cancel,
            RegisterWorker: self._on_register,
            Heartbeat: self._on_heartbeat,
            WorkerLost: self._on_lost,
            ItemDone: self._on_done,
            ItemFailed: self._on_failed,
            ItemYielded: self._on_yielded,
            Reassign: self._on_reassign,
            Drain: self._on_drain,
            Tick: self._on_tick,
        }

    # ------------------------------------------------------------------ public
    @property
    def now(self) -> float:
        """The time of the last ``handle`` call (``-inf`` before the first)."""
        return self._now

    def handle(self, event: Event, *, now: float | None = None) -> list[Action]:
        """Apply one event at ``now`` (default: the clock) and return the actions to execute.

        The driver must execute the actions in order. Never raises on a bad
        event (that is a ``Rejected`` action). Raises ``ClockError`` if time went
        backwards or there is no time source, and ``PolicyContractError`` if the
        routing policy misbehaved (with the actions produced so far attached).
        """
        if now is None:
            if self._clock is None:
                raise ClockError("no clock: construct with clock=... or pass now=")
            now = self._clock.now()
        if now < self._now:
            raise ClockError(f"time went backwards: {now} after {self._now}")
        self._now = now
        out: list[Action] = []
        try:
            for w in self._pools.expired(now):
                self._drop_worker(w, f"no heartbeat for {w.timeout:g} s", now, out)
            handler = self._handlers.get(type(event))
            if handler is None:
                name = type(event).__name__
                out.append(Rejected("bad_event", f"{name} is not an orchestrator event", name))
            else:
                handler(event, now, out)
            if self._settle:
                self._settle_workers(out)
            self._pump(now, out)
        except PolicyContractError as e:
            e.actions = out
            raise
        return out

    def live_workers(self) -> list[str]:
        """Ids of the live workers, in registration order (O(workers), no copy of state)."""
        return list(self._pools.workers)

    def is_live(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is a live worker now. O(1)."""
        return worker_id in self._pools.workers

    def next_deadline(self) -> float | None:
        """The next time at which the core acts on its own (a heartbeat deadline), or
        ``None``. A driver with no other event before then calls ``handle(Tick())``."""
        return self._pools.next_deadline()

    def snapshot(self) -> CoreSnapshot:
        """A copy of the whole state (O(size)): for metrics and invariant checks."""
        workers = tuple(
            WorkerSnapshot(
                w.worker_id,
                w.stage,
                w.seq,
                dict(w.labels),
                w.advertised,
                w.held,
                w.free,
                w.expires_at,
                tuple(w.running),
                w.stages,
                w.state,
            )
            for w in self._pools.workers.values()
        )
        requests = tuple(
            RequestSnapshot(
                r.rid,
                r.cls.name,
                r.stage,
                "running" if r.worker is not None else "queued",
                r.attempt,
                r.worker.worker_id if r.worker is not None else None,
                r.reserved,
                r.since,
                r.yielded_at(r.stage),
            )
            for r in self._requests.values()
        )
        return CoreSnapshot(
            now=self._now,
            workers=workers,
            requests=requests,
            queued={s: tuple(r.rid for r in q) for s, q in self._queues.items()},
            free_credits=dict(self._pools.free_total),
            decode_reserved=self._decode_reserved,
            finished=dict(self._finished),
        )

    # ------------------------------------------------------------------ events
    def _on_submit(self, ev: Submit, now: float, out: list[Action]) -> None:
        rid = ev.request_id
        if not _ok_id(rid):
            return _reject(out, "bad_value", f"request_id must be 1..{MAX_ID} characters", ev)
        if rid in self._requests or rid in self._finished:
            state = "live" if rid in self._requests else self._finished[rid]
            return _reject(out, "duplicate_request", f"request {rid!r} is already {state}", ev)
        name = ev.slo_class if ev.slo_class is not None else self.config.default_class
        cls = self._classes.get(name)
        if cls is None:
            known = ", ".join(self._classes)
            return _reject(out, "unknown_class", f"unknown SLO class {name!r}; known: {known}", ev)
        if len(ev.params) > MAX_HANDLE_BYTES:
            return _reject(out, "bad_value", f"params exceed {MAX_HANDLE_BYTES} bytes", ev)
        cached = ev.cached_embeddings
        if cached is not None and not 0 < len(cached) <= MAX_HANDLE_BYTES:
            msg = f"cached_embeddings must be a handle of 1..{MAX_HANDLE_BYTES} bytes, or None"
            return _reject(out, "bad_value", msg, ev)
        deadline = ev.deadline if ev.deadline is not None else now + cls.deadline
        stages = _FULL if cached is None else _CACHED
        first = cached or b""
        req = _Request(
            rid,
            cls,
            ev.params,
            deadline,
            stages,
            first,
            _NO_HINT,
            now,
            now,
            submitted_at=now,
            first_input=first,
        )
        self._requests[rid] = req
        self._enqueue(req, now)

    def _on_cancel(self, ev: Cancel, now: float, out: list[Action]) -> None:
        req = self._requests.get(ev.request_id)
        if req is None:
            outcome = self._finished.get(ev.request_id)
            if outcome is not None:
                msg = f"request {ev.request_id!r} already {outcome}"
                return _reject(out, "already_finished", msg, ev)
            return _reject(out, "unknown_request", f"no request {ev.request_id!r}", ev)
        reason = ev.reason[:MAX_REASON]
        self._finish(req, "cancelled", RequestCancelled(req.rid, reason), out, reason)

    def _on_register(self, ev: RegisterWorker, now: float, out: list[Action]) -> None:
        wid = ev.worker_id
        if not _ok_id(wid):
            return _reject(out, "bad_value", f"worker_id must be 1..{MAX_ID} characters", ev)
        stages = _stages(ev.stages or (ev.stage,), out, ev)
        if stages is None:
            return None
        if ev.stage not in stages:
            return _reject(out, "bad_value", f"stage {ev.stage!r} is not in stages", ev)
        stages = (ev.stage, *(s for s in stages if s != ev.stage))  # ``stage`` first
        old = self._pools.workers.get(wid)
        if old is not None and old.state != "loading":
            return _reject(out, "duplicate_worker", f"worker {wid!r} is already live", ev)
        if not _ok_credits(ev.credits):
            return _reject(out, "bad_value", f"credits must be an int >= 0: {ev.credits!r}", ev)
        labels = ev.labels
        if not (
            isinstance(labels, dict)
            and len(labels) <= MAX_LABELS
            and all(_ok_id(k) and _ok_id(v) for k, v in labels.items())
        ):
            msg = f"labels must be at most {MAX_LABELS} non-empty str -> str pairs"
            return _reject(out, "bad_value", msg, ev)
        timeout = ev.heartbeat_timeout
        if timeout is None:
            timeout = self.config.heartbeat_timeout
        elif not timeout > 0:
            return _reject(out, "bad_value", f"heartbeat_timeout must be > 0: {timeout}", ev)
        if old is not None:  # it loaded the stages LoadStages named: its old record goes
            self._pools.remove(old)
        self._pools.add(wid, stages, ev.credits, dict(labels), timeout, now)

    def _on_heartbeat(self, ev: Heartbeat, now: float, out: list[Action]) -> None:
        w = self._pools.workers.get(ev.worker_id)
        if w is None:
            return _reject(out, "unknown_worker", _unknown_worker(ev.worker_id), ev)
        if ev.credits is not None and not _ok_credits(ev.credits):
            return _reject(out, "bad_value", f"credits must be an int >= 0: {ev.credits!r}", ev)
        self._pools.touch(w, now)
        if ev.credits is not None:
            self._pools.advertise(w, ev.credits)

    def _on_lost(self, ev: WorkerLost, now: float, out: list[Action]) -> None:
        w = self._pools.workers.get(ev.worker_id)
        if w is None:
            return _reject(out, "unknown_worker", _unknown_worker(ev.worker_id), ev)
        self._drop_worker(w, ev.reason[:MAX_REASON], now, out)

    def _on_done(self, ev: ItemDone, now: float, out: list[Action]) -> None:
        req = self._held(ev, out)
        if req is None:
            return
        if len(ev.output) > MAX_HANDLE_BYTES:
            return _reject(out, "bad_value", f"output exceeds {MAX_HANDLE_BYTES} bytes", ev)
        w = self._release_worker(req, now)
        if req.index + 1 == len(req.stages):
            done = RequestCompleted(req.rid, ev.output, req.submitted_at, now, req.deadline)
            self._finish(req, "completed", done, out)
            return
        if req.index:
            req.prior += (req.input,)
        if req.attempt != 1:  # 1 is not written: see left_attempts
            req.remember(req.stage, req.attempt)
        req.index += 1
        tried = req.tried  # a stage ahead has an entry only if a rerun went back from it
        req.attempt = tried.get(req.stage, 0) if tried else 0
        req.input = ev.output
        req.hint = w.labels
        self._enqueue(req, now)

    def _on_failed(self, ev: ItemFailed, now: float, out: list[Action]) -> None:
        req = self._held(ev, out)
        if req is None:
            return
        self._release_worker(req, now)
        reason = f"{req.stage} attempt {req.attempt} on {ev.worker_id}: {ev.reason[:MAX_REASON]}"
        if ev.input_lost is True and self._may_rerun(req):
            return self._rerun(req, reason, out)
        self._retry_or_fail(req, reason, bool(ev.retryable), out)

    def _may_rerun(self, req: _Request) -> bool:
        """A stage before this one made its input, reruns are left, and both stages
        have attempts left (the failed one would be retried; the upstream one re-runs)."""
        if req.index == 0 or req.reruns >= self.config.max_reruns:
            return False
        upstream = req.stages[req.index - 1]
        budget = self.config.max_attempts
        return req.spent < budget and req.left_attempts(upstream) < budget

    def _rerun(self, req: _Request, reason: str, out: list[Action]) -> None:
        """The current stage's input is gone: go back to the stage that produced it."""
        lost_stage = req.stage
        req.reasons += (reason,)
        req.reruns += 1
        if lost_stage == "denoise":
            self._unreserve(req)  # admission reserves again
        req.lost += (req.input,)  # index > 0 (``_may_rerun``): an output, not first_input
        req.remember(lost_stage, req.attempt)
        req.index -= 1
        if req.index:
            req.input = req.prior[-1]
            req.prior = req.prior[:-1]
        else:
            req.input = req.first_input
        req.attempt = req.left_attempts(req.stage)
        out.append(Rerun(req.rid, req.stage, lost_stage, reason))
        self._enqueue(req, req.since)

    def _on_yielded(self, ev: ItemYielded, now: float, out: list[Action]) -> None:
        req = self._held(ev, out)
        if req is None:
            return
        w = req.worker
        assert w is not None
        leaving = w.state != "serving"  # changing stage or draining: any item may come back
        if not (req.preempting or leaving):
            what = f"{ev.stage} attempt {ev.attempt} of {ev.request_id!r}"
            return _reject(out, "bad_value", f"{what} was not asked to yield", ev)
        self._release_worker(req, now)
        if req.yielded is None:
            req.yielded = {}
        req.yielded[req.stage] = req.yielded_at(req.stage) + 1
        if not leaving:
            req.yields += 1  # a priority preemption: bounded by max_preemptions
        self._unreserve(req)  # admission reserves again
        self._enqueue(req, req.since)

    def _on_reassign(self, ev: Reassign, now: float, out: list[Action]) -> None:
        w = self._leaving(ev, out)
        if w is None:
            return
        stages = _stages(ev.stages, out, ev)
        if stages is None:
            return
        if set(stages) == set(w.stages):
            msg = f"worker {w.worker_id!r} already holds {', '.join(stages)}"
            return _reject(out, "bad_value", msg, ev)
        w.target = stages
        self._stop_serving(w, "changing", ev.reason[:MAX_REASON], "stage change", out)

    def _on_drain(self, ev: Drain, now: float, out: list[Action]) -> None:
        w = self._leaving(ev, out, also=("changing", "loading"))  # leaving wins over a change
        if w is None:
            return
        self._stop_serving(w, "draining", ev.reason[:MAX_REASON], "drain", out)

    def _on_tick(self, ev: Tick, now: float, out: list[Action]) -> None:
        pass  # expiry already ran in handle()

    # ------------------------------------------------------------------ stage changes, drains
    def _leaving(
        self, ev: Reassign | Drain, out: list[Action], also: tuple[WorkerState, ...] = ()
    ) -> Worker | None:
        """The live worker ``ev`` names, if it may start leaving its stages; else reject."""
        w = self._pools.workers.get(ev.worker_id)
        if w is None:
            return _reject(out, "unknown_worker", _unknown_worker(ev.worker_id), ev)
        if w.state != "serving" and w.state not in also:
            return _reject(out, "not_serving", f"worker {w.worker_id!r} is {w.state}", ev)
        return w

    def _stop_serving(
        self, w: Worker, state: WorkerState, reason: str, what: str, out: list[Action]
    ) -> None:
        """Take ``w`` out of service; ask each running denoise job to yield (once)."""
        w.reason = reason
        self._pools.set_state(w, state)
        why = f"{what}: {reason}"
        for req in map(self._requests.__getitem__, w.running):
            if req.stage == "denoise" and not req.preempting:
                if self._victims is not None:
                    self._victims.stopped(req)  # not a victim of the priority rule any more
                req.preempting = True
                out.append(Preempt(w.worker_id, req.rid, "denoise", req.attempt, why))
        if not w.running:
            self._settle.append(w)

    def _settle_workers(self, out: list[Action]) -> None:
        """Workers that stopped serving and hold nothing now: load, or leave."""
        pending, self._settle = self._settle, []
        for w in pending:
            if w.owner is not self._pools.token or w.running:
                continue  # gone already (lost, expired), or settled by an earlier entry
            if w.state == "changing":
                self._pools.set_state(w, "loading")
                out.append(LoadStages(w.worker_id, w.target, w.reason))
            elif w.state == "draining":
                self._pools.remove(w)
                out.append(WorkerRemoved(w.worker_id, w.reason, (), ()))

    # ------------------------------------------------------------------ lifecycle
    def _held(self, ev: ItemDone | ItemFailed | ItemYielded, out: list[Action]) -> _Request | None:
        """The request if ``ev`` comes from the worker holding its current attempt; else
        reject (stale attempts and results for items not held are dropped here)."""
        rid, stage, attempt, wid = ev.request_id, ev.stage, ev.attempt, ev.worker_id
        req = self._requests.get(rid)
        if req is not None and stage == req.stage:
            w = req.worker
            if attempt == req.attempt and w is not None and w.worker_id == wid:
                return req  # the common case first: no message is built
        what = f"{stage} attempt {attempt} of {rid!r} from {wid!r}"
        if stage not in STAGES:
            msg = f"unknown stage {stage!r}; stages: {', '.join(STAGES)}"
            return _reject(out, "unknown_stage", msg, ev)
        if req is None:
            outcome = self._finished.get(rid)
            if outcome is not None:
                return _reject(out, "stale_attempt", f"{what}: request already {outcome}", ev)
            return _reject(out, "unknown_request", f"{what}: no such request", ev)
        if stage != req.stage:
            if stage in req.stages[: req.index]:
                return _reject(out, "stale_attempt", f"{what}: {stage} already done", ev)
            return _reject(out, "not_held", f"{what}: the request is at {req.stage}", ev)
        w = req.worker
        if isinstance(attempt, int) and 1 <= attempt < req.attempt:
            return _reject(out, "stale_attempt", f"{what}: attempt {req.attempt} is current", ev)
        if attempt == req.attempt and attempt >= 1 and w is None:
            return _reject(out, "stale_attempt", f"{what}: it was re-queued", ev)
        holder = f"held by {w.worker_id!r}" if w is not None else "queued"
        return _reject(out, "not_held", f"{what}: not held (attempt {req.attempt} is {holder})", ev)

    def _release_worker(self, req: _Request, now: float) -> Worker:
        w = req.worker
        assert w is not None
        w.running.remove(req.rid)
        self._pools.release(w)
        self._pools.touch(w, now)
        if w.state != "serving" and not w.running:
            self._settle.append(w)
        if self._victims is not None:
            self._victims.stopped(req)
        req.worker = None
        return w

    def _enqueue(self, req: _Request, since: float) -> None:
        stage = req.stage
        if stage == "decode":
            self._reserve(req)
        req.preempting = False
        req.since = since
        req.token = self._queues[stage].push(req, req.cls.name, since)

    def _retry_or_fail(
        self, req: _Request, reason: str, retryable: bool, out: list[Action]
    ) -> bool:
        """After a failed attempt (not running any more): re-queue, or fail the request.
        Returns whether it was re-queued."""
        req.reasons += (reason,)
        if retryable and req.spent < self.config.max_attempts:
            out.append(Requeued(req.rid, req.stage, req.attempt, reason))
            if req.stage == "denoise":
                self._unreserve(req)  # admission reserves again
            self._enqueue(req, req.since)
            return True
        self._finish(req, "failed", RequestFailed(req.rid, req.reasons), out)
        return False

    def _drop_worker(self, w: Worker, why: str, now: float, out: list[Action]) -> None:
        self._pools.remove(w)
        at = len(out)
        requeued: list[str] = []
        failed: list[str] = []
        reqs = [self._requests[rid] for rid in w.running]
        w.running.clear()
        w.held = 0
        for req in reqs:
            if self._victims is not None:
                self._victims.stopped(req)
            req.worker = None
            reason = f"{req.stage} attempt {req.attempt} on {w.worker_id}: {why}"
            ok = self._retry_or_fail(req, reason, True, out)
            (requeued if ok else failed).append(req.rid)
        out.insert(at, WorkerRemoved(w.worker_id, why, tuple(requeued), tuple(failed)))

    def _finish(
        self, req: _Request, outcome: str, action: Action, out: list[Action], why: str = ""
    ) -> None:
        """End ``req``: free its queue slot, credit and reservation; remember the id."""
        if req.token:
            self._queues[req.stage].discard(req.token, req.cls.name)
            req.token = 0
        w = req.worker
        if w is not None:  # cancelled while running
            w.running.remove(req.rid)
            self._pools.release(w)
            if w.state != "serving" and not w.running:
                self._settle.append(w)
            if self._victims is not None:
                self._victims.stopped(req)
            req.worker = None
            out.append(Revoke(w.worker_id, req.rid, req.stage, req.attempt, why))
        self._unreserve(req)
        del self._requests[req.rid]
        self._finished[req.rid] = outcome
        self._finished_ids[self._finished_n] = req.rid
        self._finished_n += 1
        if len(self._finished) > self.config.finished_memory:
            oldest = self._finished_n - len(self._finished)
            del self._finished[self._finished_ids.pop(oldest)]
        out.append(action)
        kept = (*req.lost, *req.prior, req.input) if req.index else req.lost  # its outputs
        out.append(ReleasePayloads(req.rid, kept))

    def _reserve(self, req: _Request) -> None:
        if not req.reserved:
            req.reserved = True
            self._decode_reserved += 1

    def _unreserve(self, req: _Request) -> None:
        if req.reserved:
            req.reserved = False
            self._decode_reserved -= 1

    # ------------------------------------------------------------------ dispatch
    def _pump(self, now: float, out: list[Action]) -> None:
        free = self._pools.free_total
        for stage in _PUMP_ORDER:
            q = self._queues[stage]
            while free[stage] > 0 and q.live:
                if stage == "denoise" and free["decode"] <= self._decode_reserved:
                    break  # no decode credit to reserve for the latent
                req = q.pop(now)
                assert req is not None
                self._dispatch(req, stage, q, out, now)
        if self.config.preemption:
            self._preempt(out)

    def _preempt(self, out: list[Action]) -> None:
        """The preemption rule (module docstring), from ``victims.py``'s index of the
        running denoise jobs: O(log n) per victim, no scan of the pool."""
        q = self._queues["denoise"]
        if not q or self._pools.free_total["denoise"] > 0:
            return
        victims = self._victims
        assert victims is not None
        while (v := victims.first()) is not None:
            if q.waiting_better_than(v.cls.priority) <= victims.pending:
                break  # victims further on are of higher classes: fewer jobs outrank them
            assert v.worker is not None
            victims.take(v)
            why = "a higher-priority denoise job waits"
            out.append(Preempt(v.worker.worker_id, v.rid, "denoise", v.attempt, why))

    def _dispatch(
        self, req: _Request, stage: Stage, q: ClassQueue[_Request], out: list[Action], now: float
    ) -> None:
        req.token = 0
        attempt = req.attempt + 1
        item = WorkItem(
            req.rid, stage, attempt, req.cls.name, req.deadline, req.params, req.input, req.hint
        )
        pools = self._pools
        try:
            if self._index is not None:
                w: Any = self._index.pick(item)
            else:
                w = self.policy.choose(item, pools.candidates(stage))
        except Exception as e:
            req.token = q.push(req, req.cls.name, req.since)
            raise PolicyContractError(f"routing policy raised on {stage} item: {e!r}") from e
        if (
            getattr(w, "owner", None) is not pools.token  # one of our live workers
            or stage not in w.stages
            or w.state != "serving"
            or w.free < 1
        ):
            req.token = q.push(req, req.cls.name, req.since)
            raise PolicyContractError(
                f"routing policy chose {w!r}, not a serving {stage} worker with a free credit"
            )
        req.attempt = attempt
        req.worker = w
        w.running.append(req.rid)
        pools.hold(w)
        if stage == "denoise":
            if "decode" not in w.stages:  # else its own credit is its latent's (docstring)
                self._reserve(req)
            if self._victims is not None:
                req.started = now
                self._victims.started(req)
        elif stage == "decode":
            self._unreserve(req)
        out.append(Dispatch(w.worker_id, item))


def _ok_credits(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _stages(given: object, out: list[Action], ev: object) -> tuple[Stage, ...] | None:
    """``given`` as a tuple of known stages, non-empty and without repeats; else reject."""
    if not isinstance(given, tuple | list) or not given:
        return _reject(out, "bad_value", "stages must name at least one stage", ev)
    for s in given:
        if s not in STAGES:
            msg = f"unknown stage {s!r}; stages: {', '.join(STAGES)}"
            return _reject(out, "unknown_stage", msg, ev)
    if len(set(given)) != len(given):
        return _reject(out, "bad_value", f"stages repeat: {list(given)}", ev)
    return cast(tuple[Stage, ...], tuple(given))


def _unknown_worker(wid: str) -> str:
    return f"no live worker {wid!r} (never registered, or declared dead: register again)"


def _reject(out: list[Action], code: RejectCode, reason: str, ev: object) -> None:
    out.append(Rejected(code, reason, type(ev).__name__))

"""The orchestrator as a running service: the core, a ZeroMQ worker channel and a client API.

Library mode (in-process, what engines embed) and the standalone command
(``mooncake-diffusion orchestrator``, which adds ``api.py``'s HTTP API) are the
same object:

    svc = OrchestratorService(ServiceConfig(journal="orch.db")).start()
    svc.worker_address                         # tcp://127.0.0.1:PORT for StageWorkers
    rid = svc.submit({"prompt": "a cat"}, slo_class="interactive")
    for ev in svc.events(rid): ...             # submitted, dispatched, progress, done, ...
    svc.wait(rid, timeout=60).output           # the last stage's output handle
    svc.cancel(rid); svc.status(rid); svc.cluster(); svc.metrics_text()
    svc.reassign("den-1", ("decode",), "mix moved")   # elastic pools (a planner calls these)
    svc.drain("den-2", "scale-down")
    svc.close()                                # stops the driver; the journal keeps the rest

Threads: one driver owns the core, the ROUTER socket and the request table; it
runs every event to completion before the next. API calls (from any thread) are
posted to it and wait for its answer (``call_timeout_s``), so the API never sees
a half-applied event. The driver is a thread of its own (``start``), or turns on
an asyncio loop that also serves the HTTP API (``run_on_loop``, what the
standalone command does through ``ApiServer(drive=True)``): there an API call
made on that loop is taken by the next turn with no thread hand-off, and no
second Python thread contends for the interpreter lock. With a journal, every accepted event is
committed before its actions take effect (``JournaledOrchestrator``), and a
restarted service replays it: statuses are rebuilt, running items are re-sent.
Group commit: each turn of the driver loop (every worker frame and API call
ready at one poll, up to ``_TURN_FRAMES`` frames) is one journal transaction; the
frames it sends, the API answers and the stream events it produces are held until
that commit, then go out in order. One write per turn instead of one per event is
what lets 1,024 workers' heartbeats and 1,000 submissions/s share one thread. A
turn stops taking frames as soon as an API call is posted (``take_frames``): a
submission that arrives during a burst of heartbeats or results waits for the
frame being handled and the turn's commit, not for the rest of the burst, which
the next turn takes.

Delivery: a ``Work`` frame can be lost (the worker was not connected yet, or
the service restarted between commit and send). Workers list what they hold in
every ``Beat``; an item dispatched more than ``resend_after_s`` ago that the
worker does not list is sent again. Workers ignore copies of what they run and
answer a copy of what they finished with their ``Done`` again, so resending is
safe. A ``Done`` lost the other way is recovered the same way. A ``Release``
(drop a finished request's outputs) can be lost too: the service died between
committing the request's end and the frame leaving. A restarted service sends the
releases of the last ``_REDELIVER`` requests that ended before it went down again,
each to its producer once that worker speaks to the new service (only then can it
be routed to); a producer that is gone hands its share to whichever worker speaks
next (in store mode any worker's cleanup removes a request's objects).
Releasing twice is safe: nothing is left to drop. A request that ends failed or
cancelled after a denoise attempt also has its step checkpoints dropped (nobody will
resume it): its last denoise item goes in a ``Release`` to the worker that ran it,
or to another live denoise worker (``worker.Resumable``); with none alive, they
stay (soft-pinned: evictable).

Stage changes and drains: ``reassign`` and ``drain`` feed the core's
``Reassign`` and ``Drain`` (a worker's own ``Leave``, on SIGTERM, is a ``Drain``
too); its ``Preempt`` actions go out as ``Yield``. ``LoadStages`` goes to the
worker as ``Load``; its next ``Hello`` registers it with the new stages, and
the seconds it spent loading are logged and kept (``stage_changes``: the last
``_RECENT``, with ``cluster()``'s view and the ``stage_changes`` counter). A
worker drained by the service is told to exit (``Retire``) once the core
removed it.

Errors raised to API callers: ``RequestRejected`` (``code`` as the core's
``Rejected``: ``duplicate_request``, ``unknown_class``, ``bad_value``,
``unknown_request``, ``already_finished``) and ``ServiceUnavailable`` (closed or
not answering). Bad worker frames are logged and answered with ``Refused``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import queue
import secrets
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from mooncake_diffusion.orchestrator.core.clock import Clock, StallClock
from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Cancel,
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
    Rejected,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Rerun,
    Revoke,
    Submit,
    Tick,
    WorkerLost,
    WorkerRemoved,
    WorkItem,
)
from mooncake_diffusion.orchestrator.core.policy import RoutingPolicy
from mooncake_diffusion.orchestrator.elastic.contract import Decision, Planner, Provisioner
from mooncake_diffusion.orchestrator.elastic.driver import Elastic, pool_sizes
from mooncake_diffusion.orchestrator.elastic.planners import create_planner
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.link.inbox import Inbox
from mooncake_diffusion.orchestrator.link.wire import (
    Beat,
    Bye,
    Done,
    Drop,
    Failed,
    Hello,
    ItemRef,
    Leave,
    Load,
    Memory,
    Progress,
    Refused,
    Release,
    Retire,
    Welcome,
    WireError,
    Work,
    Yield,
    Yielded,
    decode_from_worker,
    encode,
)
from mooncake_diffusion.orchestrator.service.journal import (
    EventLog,
    Journal,
    JournaledOrchestrator,
    JournalError,
)
from mooncake_diffusion.orchestrator.service.metrics import ServiceMetrics
from mooncake_diffusion.orchestrator.service.stalls import STALL_S, StallWatch
from mooncake_diffusion.orchestrator.service.status import (
    TERMINAL,
    RequestEvent,
    RequestStatus,
    RequestTable,
)

__all__ = [
    "MAX_PARAMS_BYTES",
    "OrchestratorService",
    "RequestRejected",
    "ServiceConfig",
    "ServiceUnavailable",
]

log = logging.getLogger("mooncake_diffusion.orchestrator")

MAX_PARAMS_BYTES = 64 * 1024


class RequestRejected(OrchestratorError):
    """The request was not accepted (or does not exist); nothing changed. ``code``
    is the core's reject code."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ServiceUnavailable(OrchestratorError):
    """The service is closed, or its driver did not answer in time. Retryable."""

    retryable = True


#: worker frames handled in one driver turn (one journal commit) at most: it bounds
#: the most worker frames one turn (one commit) takes when no API call waits; 1,024
#: beats a second are still only 16 commits
_TURN_FRAMES = 64
#: the same on a shared asyncio loop, where HTTP requests are read only between turns
_LOOP_TURN_FRAMES = 16
#: the longest a loop-driven driver sleeps with nothing due (it then looks again)
_LOOP_IDLE_S = 1.0
#: Finished request ids ``cluster()`` lists (newest last), for dashboards.
_RECENT = 50
#: releases of the requests that ended last before a restart, sent again (module doc)
_REDELIVER = 64


@dataclass(frozen=True)
class ServiceConfig:
    """``worker_bind``: the ZeroMQ endpoint workers connect to (port 0 picks a free
    one). ``journal``: a SQLite path, or None for no durability. ``token``: when
    set, workers must present it in ``Hello`` (the HTTP API checks it too); it is
    required when ``worker_bind`` is not loopback. ``resend_after_s``: see the
    module docstring. ``max_finished``: finished statuses kept for the API.
    ``planner``: the planner's registry name (``planners.py``; ``static`` changes
    nothing), built with ``planner_options``; ``planner_window``: seconds of
    history its views cover (``planview.PlanWindow``)."""

    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    worker_bind: str = "tcp://127.0.0.1:7422"
    journal: str | None = None
    token: str | None = None
    resend_after_s: float = 1.0
    max_finished: int = 10_000
    call_timeout_s: float = 10.0
    planner: str = "static"
    planner_options: dict[str, Any] = field(default_factory=dict)
    planner_window: float = 10.0

    def __post_init__(self) -> None:
        host = self.worker_bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        loopback = host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
        if self.worker_bind.startswith("tcp://") and not loopback and not self.token:
            raise OrchestratorError(
                f"worker_bind {self.worker_bind} is not loopback: set a token "
                "(--token or MCD_ORCHESTRATOR_TOKEN) so only your workers can join"
            )


class _Outstanding(msgspec.Struct):
    worker_id: str
    frame: bytes
    sent_at: float


class OrchestratorService:
    """See the module docstring. ``clock``: default a ``StallClock`` (monotonic time
    less the driver's own stalls, which a ``StallWatch`` notices); ``policy``: a
    routing policy instance (default: ``config.orchestrator.policy``); ``planner``: a
    planner instance (default: ``config.planner``), run on the driver thread every
    ``planner.interval`` (``elastic.Elastic``); ``provisioner``: where its
    ``AddWorker`` / ``Retire`` decisions go (none: they are counted, not acted on)."""

    def __init__(
        self,
        config: ServiceConfig | None = None,
        *,
        clock: Clock | None = None,
        policy: RoutingPolicy | None = None,
        planner: Planner | None = None,
        provisioner: Provisioner | None = None,
    ) -> None:
        self.config = config or ServiceConfig()
        planner = planner or create_planner(self.config.planner, **self.config.planner_options)
        self._elastic = Elastic(planner, provisioner, window=self.config.planner_window)
        #: worker -> the stages it held when told to load others (for stage_changes)
        self._before: dict[str, tuple[str, ...]] = {}
        self._clock = clock or StallClock()
        self._policy = policy
        self.table = RequestTable(self.config.max_finished)
        self._mail: Inbox[tuple[Callable[[], Any], Future]] = Inbox()
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        #: the asyncio loop the driver turns on (``run_on_loop``), and its state there
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._local: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._kicked = False
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None
        self._watch: StallWatch | None = None
        self._stopping = False
        self._closed = False
        self._core: Orchestrator | JournaledOrchestrator | None = None
        self._outstanding: dict[ItemRef, _Outstanding] = {}
        self._outstanding_of: dict[str, set[ItemRef]] = {}  # the same, by worker
        self._producers: dict[str, set[str]] = {}
        #: live request -> (worker, item) of its last denoise dispatch (``_resumable_of``)
        self._resumable: dict[str, tuple[str, WorkItem]] = {}
        #: releases that may have been lost in a restart (filled by the journal's replay):
        #: request -> its producers still owed one
        self._redeliver: OrderedDict[str, set[str]] = OrderedDict()
        #: with a token: each worker connection that said Hello with it -> the session
        #: key its later frames must carry (a routing id alone can be taken over)
        self._authed: OrderedDict[bytes, str] = OrderedDict()
        #: workers sent ``Load`` and not registered again: worker -> (stages, reason, t)
        self._loading: dict[str, tuple[tuple[str, ...], str, float]] = {}
        #: workers whose Drain the core accepted and has not removed yet
        self._draining: set[str] = set()
        #: what each live worker's connector held at its last beat that said (``Beat.memory``)
        self._memory: dict[str, Memory] = {}
        #: the last stage changes, oldest first: worker_id, stages, reason, load_s, s
        self.stage_changes: deque[dict[str, Any]] = deque(maxlen=_RECENT)
        #: during a driver turn (``_turn``): frames and API answers held for its commit
        self._frames: list[tuple[bytes, bytes]] | None = None
        self._answers: list[tuple[Future, Any, BaseException | None]] = []
        self._counters: Counter[str] = Counter()
        self.metrics = ServiceMetrics()
        self.worker_address = ""
        #: set when the driver thread has ended (closed, or stopped by ``failure``)
        self.stopped = threading.Event()
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> OrchestratorService:
        """Bind the worker socket, recover the journal, start the driver thread."""
        if self._thread is not None or self._aloop is not None:
            raise OrchestratorError("the service is already running")
        router = self._bind()
        opened: Future = Future()
        self._thread = threading.Thread(
            target=self._run, args=(opened,), name="mcd-orchestrator", daemon=True
        )
        self._thread.start()
        try:
            opened.result()
        except BaseException:
            self._thread.join()
            self._unbind(router)
            raise
        return self

    def run_on_loop(self) -> None:
        """Instead of ``start``: bind, recover the journal and drive the service from
        the running asyncio loop's thread (this call's), which must go on running
        the loop; returns once the service is ready. Obligations: call it on that
        thread, on a service never started; call ``leave_loop`` on the same thread
        before the loop ends. Never call a blocking method of this service
        (``submit``, ``status``...) on that thread: it would wait for itself (it
        raises ``OrchestratorError``); the ``*_async`` ones are for it. Raises like
        ``start``."""
        if self._thread is not None or self._aloop is not None:
            raise OrchestratorError("the service is already running")
        loop = asyncio.get_running_loop()
        router = self._bind()
        try:
            self._open_core()
        except BaseException:
            if isinstance(self._core, JournaledOrchestrator):
                self._core.close()  # recovered, then failed: release the journal
            self._unbind(router)
            raise
        self._aloop, self._loop_thread = loop, threading.get_ident()
        self._watch = self._open_watch()
        loop.add_reader(router.getsockopt(zmq.FD), self._kick)
        loop.add_reader(self._mail.fileno(), self._kick)
        self._kick()

    def leave_loop(self) -> None:
        """On the loop's thread: stop driving (the journal is closed, API calls not
        yet taken fail with ``ServiceUnavailable``, ``stopped`` is set). Idempotent;
        ``close`` calls it through the loop."""
        loop = self._aloop
        if loop is None or self.stopped.is_set():
            return
        assert self._router is not None
        with contextlib.suppress(ValueError, zmq.ZMQError):  # the socket is gone already
            loop.remove_reader(self._router.getsockopt(zmq.FD))
        loop.remove_reader(self._mail.fileno())
        if self._timer is not None:
            self._timer.cancel()
        local, self._local = self._local, []
        for _, fut in local:
            if not fut.done():
                fut.set_exception(self._stopped_error())
        self._driver_ended(self._watch)

    def _bind(self) -> zmq.Socket:
        """The worker channel's ROUTER socket, bound to ``config.worker_bind``."""
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its id back
        router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        try:
            router.bind(self.config.worker_bind)
        except zmq.ZMQError as e:
            router.close()
            self._ctx.term()
            raise OrchestratorError(f"cannot bind {self.config.worker_bind}: {e}") from e
        self._router = router
        self.worker_address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        return router

    def _unbind(self, router: zmq.Socket) -> None:
        """After a start that failed: nothing of it stays open."""
        self._closed = True
        router.close()
        assert self._ctx is not None
        self._ctx.term()
        self._mail.close()

    def _open_core(self) -> None:
        """In the driver thread (SQLite objects stay in the thread that made them)."""
        cfg = self.config.orchestrator
        journal = self._journal()
        if journal is not None:
            self._core = JournaledOrchestrator.recover(
                journal,
                cfg,
                clock=self._clock,
                policy=self._policy,
                observer=self._replayed,
            )
            # The core resumed at the journal's last event (workers could not reach us
            # while we were down): re-send what it says is running, then give each
            # recovered worker a full heartbeat deadline from there, executing what
            # that does like any other actions (one whose deadline had already come
            # is removed, its items re-queued and dispatched again).
            with self._turn():
                for d in self._core.recovered_dispatches:
                    self._send_work(d)
                for wid in self._core.live_workers():
                    with contextlib.suppress(RequestRejected):  # it expired just now
                        self._feed(Heartbeat(wid), None)
            if self.failure is not None:
                raise self.failure
        else:
            self._core = Orchestrator(cfg, clock=self._clock, policy=self._policy)

    def _journal(self) -> EventLog | None:
        """The journal to recover from, opened in the driver thread: the SQLite file
        ``config.journal`` names, or None (``ha_service`` gives its etcd journal)."""
        return Journal(self.config.journal) if self.config.journal else None

    def close(self) -> None:
        """Stop the driver and close sockets and the journal. Idempotent. Event streams end."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stopping = True
            self._mail.wake()
            self._thread.join(timeout=10)
        elif self._on_loop():
            self.leave_loop()
        elif self._aloop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended (it left first)
                self._aloop.call_soon_threadsafe(self.leave_loop)
                self.stopped.wait(10)
        if self._router is not None:
            self._router.close()
        if self._ctx is not None:
            self._ctx.term()
        self.table.close_streams()
        self._mail.close()

    def __enter__(self) -> OrchestratorService:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ client API
    def submit(
        self,
        params: dict[str, Any] | bytes = b"",
        *,
        request_id: str | None = None,
        slo_class: str | None = None,
        cached_embeddings: bytes | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Accept a request; returns its id (generated when not given). ``params``: a
        JSON-able dict (encoded as JSON) or bytes, at most ``MAX_PARAMS_BYTES``;
        every stage's worker receives it. ``deadline_s``: seconds from now (default:
        the class deadline). Raises ``RequestRejected``."""
        accept = self._accepting(params, request_id, slo_class, cached_embeddings, deadline_s)
        return self._call(accept)

    async def submit_async(
        self,
        params: dict[str, Any] | bytes = b"",
        *,
        request_id: str | None = None,
        slo_class: str | None = None,
        cached_embeddings: bytes | None = None,
        deadline_s: float | None = None,
    ) -> RequestStatus:
        """``submit`` for a caller on an asyncio loop (the HTTP API): awaits the driver
        without holding a thread, and answers with the accepted request's status from
        the same driver call (no second call for it). Raises ``RequestRejected``,
        ``ServiceUnavailable``."""
        accept = self._accepting(params, request_id, slo_class, cached_embeddings, deadline_s)
        return await self._call_async(lambda: self._status_copy(accept()))

    def _accepting(
        self,
        params: dict[str, Any] | bytes,
        request_id: str | None,
        slo_class: str | None,
        cached_embeddings: bytes | None,
        deadline_s: float | None,
    ) -> Callable[[], str]:
        """Check a submission on the caller's thread; returns the function the driver
        runs to accept it (it answers the request's id)."""
        blob = params if isinstance(params, bytes) else msgspec.json.encode(params)
        if len(blob) > MAX_PARAMS_BYTES:
            raise RequestRejected(
                "bad_value", f"params are {len(blob)} bytes; the limit is {MAX_PARAMS_BYTES}"
            )
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if deadline_s is not None and not deadline_s > 0:
            raise RequestRejected("bad_value", f"deadline_s must be > 0, got {deadline_s}")

        def run() -> str:
            deadline = None if deadline_s is None else self._now() + deadline_s
            ev = Submit(rid, slo_class, blob, cached_embeddings, deadline)
            self._feed(ev, None)
            return rid

        return run

    def cancel(self, request_id: str, reason: str = "cancelled by client") -> RequestStatus:
        """Cancel a queued or running request. Raises ``RequestRejected``
        (``unknown_request``, ``already_finished``)."""
        return self._call(lambda: self._cancelled(request_id, reason))

    async def cancel_async(
        self, request_id: str, reason: str = "cancelled by client"
    ) -> RequestStatus:
        """``cancel`` for a caller on an asyncio loop (no thread held while waiting)."""
        return await self._call_async(lambda: self._cancelled(request_id, reason))

    def _cancelled(self, request_id: str, reason: str) -> RequestStatus:
        """On the driver: cancel, then a copy of the request's status."""
        self._feed(Cancel(request_id, reason), None)
        return self._status_copy(request_id)

    def status(self, request_id: str) -> RequestStatus:
        """A copy of the request's status. Raises ``RequestRejected("unknown_request")``."""

        return self._call(lambda: self._status_copy(request_id))

    async def status_async(self, request_id: str) -> RequestStatus:
        """``status`` for a caller on an asyncio loop (no thread held while waiting)."""
        return await self._call_async(lambda: self._status_copy(request_id))

    def _status_copy(self, request_id: str) -> RequestStatus:
        """On the driver: a copy of the request's status (its lists copied, so the
        caller's thread never reads what the driver goes on changing)."""
        st = self.table.status_copy(request_id)
        if st is None:
            raise RequestRejected("unknown_request", f"no request {request_id!r}")
        return st

    def events(self, request_id: str, timeout: float | None = None) -> Iterator[RequestEvent]:
        """The request's events so far, then each new one until it finishes (or the
        service closes, or ``timeout`` seconds pass with nothing new). A stream that
        ends before its request did (the timeout, or its caller closed it) stops
        following: the driver drops its queue."""
        q: queue.SimpleQueue[RequestEvent | None] = queue.SimpleQueue()
        ended = False  # the table put None: it dropped the queue itself
        try:  # a subscribe answered too late may have subscribed: the finally drops it
            if not self._call(lambda: self.table.subscribe(request_id, q)):
                ended = True
                raise RequestRejected("unknown_request", f"no request {request_id!r}")
            while True:
                try:
                    ev = q.get(timeout=timeout)
                except queue.Empty:
                    return
                if ev is None:
                    ended = True
                    return
                yield ev
        finally:
            if not ended:
                with contextlib.suppress(ServiceUnavailable):  # stopped: nothing follows
                    self._post(lambda: self.table.unsubscribe(request_id, q))

    def wait(self, request_id: str, timeout: float | None = None) -> RequestStatus:
        """Block until the request finishes (or ``timeout``); returns its status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for ev in self.events(request_id, timeout=timeout):
            if ev.kind in TERMINAL or (deadline is not None and time.monotonic() > deadline):
                break
        return self.status(request_id)

    def reassign(self, worker_id: str, stages: tuple[str, ...], reason: str = "planner") -> str:
        """Move a live worker to ``stages`` (the core's ``Reassign``; module docstring).
        Thread-safe; returns its state right after (``changing``, or ``loading`` if it
        held nothing). Raises ``RequestRejected`` (``unknown_worker``, ``not_serving``,
        ``unknown_stage``, ``bad_value``), ``ServiceUnavailable``."""
        ev = Reassign(worker_id, tuple(stages), reason)
        return self._call(lambda: self._worker_event(ev))

    def drain(self, worker_id: str, reason: str = "drain") -> str:
        """Have a live worker leave (the core's ``Drain``): its denoise jobs move at a
        step boundary, its other items finish, then it is removed and told to exit.
        Thread-safe; returns its state right after (``draining``, or ``removed`` if it
        held nothing). Raises ``RequestRejected``, ``ServiceUnavailable``."""
        return self._call(lambda: self._worker_event(Drain(worker_id, reason)))

    def _worker_event(self, ev: Reassign | Drain) -> str:
        """On the driver: feed ``ev``; the worker's state after it."""
        self._feed(ev, None)
        assert self._core is not None
        snap = self._core.snapshot()  # O(workers): planner decisions are rare
        return next((w.state for w in snap.workers if w.worker_id == ev.worker_id), "removed")

    def cluster(self) -> dict[str, Any]:
        """Pools, queues and running requests, for dashboards and the demo's live view."""
        return self._call(self._cluster_view)

    def metrics_text(self) -> str:
        """Prometheus text exposition (format 0.0.4)."""
        return self._call(self._metrics)

    # ------------------------------------------------------------------ driver plumbing
    def _post(self, fn: Callable[[], Any]) -> Future:
        """Hand ``fn`` to the driver (its mailbox wakes the loop at once); the future
        is answered after the turn's journal commit."""
        running = self._thread is not None or self._aloop is not None
        if self._closed or not running or self.stopped.is_set():
            raise ServiceUnavailable(f"the orchestrator service is not running ({self.failure})")
        fut: Future = Future()
        self._mail.put((fn, fut))
        return fut

    def _on_loop(self) -> bool:
        """Whether this is the thread of the loop the driver turns on."""
        return self._aloop is not None and self._loop_thread == threading.get_ident()

    def _late(self) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"the orchestrator did not answer within {self.config.call_timeout_s} s"
        )

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self._on_loop():
            raise OrchestratorError("a blocking service call on the driver's own loop")
        fut = self._post(fn)
        try:
            return fut.result(timeout=self.config.call_timeout_s)
        except FutureTimeout:
            # the caller is told it failed: so it must not happen later (a submit the
            # client was answered 503 for would run, its request unknown to the client)
            fut.cancel()  # the driver skips a cancelled call; a running one ends as it does
            raise self._late() from None

    async def _call_async(self, fn: Callable[[], Any]) -> Any:
        """``_call`` awaited on the running asyncio loop: the driver's answer comes back
        through the loop (``asyncio.wrap_future``), no thread pool in between. On the
        timeout the call is cancelled if the driver has not started it. On the loop
        the driver turns on (``run_on_loop``), the call goes to its next turn."""
        fut: asyncio.Future
        if self._on_loop():
            if self._closed or self.stopped.is_set():
                raise self._stopped_error()
            fut = self._aloop.create_future()
            self._local.append((fn, fut))
            self._kick()
        else:
            fut = asyncio.wrap_future(self._post(fn))
        try:  # a timeout scope, not wait_for: no task and waiter of its own per call
            async with asyncio.timeout(self.config.call_timeout_s):
                return await fut
        except TimeoutError:
            raise self._late() from None

    def _now(self) -> float:
        assert self._core is not None
        if isinstance(self._core, JournaledOrchestrator):
            return self._core.now()
        return self._clock.now()

    def _run(self, opened: Future) -> None:
        try:
            self._open_core()
        except BaseException as e:
            if isinstance(self._core, JournaledOrchestrator):
                self._core.close()  # recovered, then failed: release the journal
            opened.set_exception(e)
            return
        opened.set_result(None)
        watch = self._open_watch()
        try:
            self._loop(watch)
        finally:
            self._driver_ended(watch)

    def _open_watch(self) -> StallWatch | None:
        """A started stall watch attached to the clock; only a clock that stalls can
        be told of stalls (a VirtualClock is the caller's): None for another."""
        if not isinstance(self._clock, StallClock):
            return None
        watch = StallWatch(clock=self._clock.source).start()
        self._clock.attach(watch)
        return watch

    def _driver_ended(self, watch: StallWatch | None) -> None:
        """On the driver, once it turns no more: release the watch and the journal,
        set ``stopped``, fail the calls nobody will answer now."""
        try:
            if watch is not None:
                assert isinstance(self._clock, StallClock)
                self._clock.detach()
                watch.close()
            if isinstance(self._core, JournaledOrchestrator):
                self._core.close()
        finally:
            self.stopped.set()
            for _, fut in self._mail.drain():
                fut.set_exception(self._stopped_error())

    def _stopped_error(self) -> ServiceUnavailable:
        return ServiceUnavailable(f"the orchestrator stopped: {self.failure}")

    def _loop(self, watch: StallWatch | None) -> None:
        """Turns until stopped. With a ``watch`` (attached to the clock), a stall of
        the driver (``stalls.py``) is out of the core's time before the next event
        it handles, so the frames queued meanwhile find their senders still live:
        a freeze at the clock's next reading, a long turn as soon as it ends."""
        router = self._router
        assert router is not None and self._core is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._mail.fileno(), zmq.POLLIN)
        while not self._stopping:
            deadline = self._core.next_deadline()
            wake = min(
                (t for t in (deadline, self._elastic.next_at()) if t is not None), default=None
            )
            # (capped: zmq takes an int of milliseconds; a far wake-up is just a long wait)
            timeout = None if wake is None else min(max(0.0, wake - self._now()), 3600.0) * 1000 + 1
            try:
                ready = dict(poller.poll(timeout))
            except zmq.ZMQError:
                break
            frozen = 0.0 if watch is None else watch.frozen()
            started = time.monotonic()
            with self._turn():
                if router in ready:
                    take_frames(router, self._on_worker_frame, self._mail.waiting, _TURN_FRAMES)
                self._turn_rest(deadline)
            if watch is not None:
                self._count_stalls(watch, time.monotonic() - started, frozen)

    def _turn_rest(self, deadline: float | None) -> None:
        """Inside a turn, after its worker frames: the API calls posted (and, on a
        loop, made on it), a tick if the heartbeat ``deadline`` has come, the
        planner if it is due."""
        for fn, fut in self._mail.drain():
            if fut.set_running_or_notify_cancel():
                self._answer(fn, fut)
        if self._local:
            local, self._local = self._local, []
            for fn, afut in local:
                if not afut.done():  # not cancelled by its caller's timeout
                    self._answer(fn, afut)
        if deadline is not None and self._now() >= deadline:
            self._guard(self._feed, Tick(), None)
        if self._elastic.due(self._now()):
            self._guard(self._plan)

    def _answer(self, fn: Callable[[], Any], fut: Future | asyncio.Future) -> None:
        try:
            self._answers.append((fut, fn(), None))
        except JournalError as e:
            self._journal_failed(e)
            self._answers.append((fut, None, e))
        except BaseException as e:
            self._answers.append((fut, None, e))

    # ------------------------------------------------------------------ on a loop
    def _kick(self) -> None:
        """Have the loop run a turn soon (once, however often it is asked)."""
        if not self._kicked and self._aloop is not None:
            self._kicked = True
            self._aloop.call_soon(self._loop_turn)

    def _loop_turn(self) -> None:
        """One turn on the loop (``_loop``'s body, with ``_LOOP_TURN_FRAMES``), then
        what brings the next: frames still queued (at once), the next heartbeat
        deadline or planner round (a timer); a call made on the loop kicks it itself."""
        self._kicked = False
        if self._stopping or self.stopped.is_set():
            return
        router, core, watch = self._router, self._core, self._watch
        assert router is not None and core is not None
        frozen = 0.0 if watch is None else watch.frozen()
        started = time.monotonic()
        with self._turn():
            # the FD only says that something changed: the socket's events tell what
            if router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                take_frames(router, self._on_worker_frame, self._mail.waiting, _LOOP_TURN_FRAMES)
            self._turn_rest(core.next_deadline())
        if watch is not None:
            self._count_stalls(watch, time.monotonic() - started, frozen)
        if self._stopping:  # the journal failed
            self.leave_loop()
            return
        if router.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # calls on the loop come after a turn
            self._kick()
        self._arm(core.next_deadline())

    def _arm(self, deadline: float | None) -> None:
        """The timer for the next turn nothing else brings."""
        assert self._aloop is not None
        now = self._now()
        due = [t for t in (deadline, self._elastic.next_at()) if t is not None]
        wake = min([*due, now + _LOOP_IDLE_S])
        timer, at = self._timer, self._wake_at
        if timer is not None and not timer.cancelled() and at is not None and now < at <= wake:
            return  # the timer set already comes first
        if timer is not None:
            timer.cancel()
        self._wake_at = wake
        self._timer = self._aloop.call_later(max(0.0, wake - now) + 0.001, self._kick)

    def _count_stalls(self, watch: StallWatch, turn_s: float, frozen_before: float) -> None:
        """After a turn: a turn that ran long past ``STALL_S`` (less the freezes in
        it, which the clock took out already) is taken out of the clock's time;
        ``driver_stall_ms`` is all the clock has taken out."""
        assert isinstance(self._clock, StallClock)
        ran_s = turn_s - (watch.frozen() - frozen_before)
        if ran_s > STALL_S:
            self._clock.stalled(ran_s)
        self._counters["driver_stall_ms"] = round(self._clock.stalls_s() * 1000)

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """One turn of the driver loop, under one group commit of the journal: the
        events it handles are written together, then their effects (frames to
        workers, answers to API calls, stream events) go out, in order. If the
        commit fails, none goes out: API calls get ``ServiceUnavailable`` and the
        driver stops (a supervisor restarts it; the journal has what was durable)."""
        assert self._core is not None
        self._frames = []
        self._answers = []
        self.table.hold()
        ok = False
        group = contextlib.ExitStack()
        try:
            try:
                if isinstance(self._core, JournaledOrchestrator):
                    group.enter_context(self._core.group())
            except JournalError as e:  # the body still runs: every event is refused
                self._journal_failed(e)
            try:
                yield
            finally:
                group.close()  # the commit
            ok = self.failure is None
        except JournalError as e:
            self._journal_failed(e)
        finally:
            frames, answers, self._frames = self._frames, self._answers, None
            self.table.release(deliver=ok)
            if ok:
                for ident, frame in frames:
                    self._push_frame(ident, frame)
            for fut, result, exc in answers:
                if ok and exc is None:
                    fut.set_result(result)
                elif isinstance(exc, JournalError) or (exc is None and not ok):
                    fut.set_exception(ServiceUnavailable(f"journal failed: {self.failure}"))
                else:
                    fut.set_exception(exc)

    def _journal_failed(self, e: JournalError) -> None:
        log.critical("orchestrator: stopping, the journal failed: %s", e)
        self.failure, self._stopping = e, True

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        """Worker traffic must never stop the driver: log and count what fails. A
        journal that cannot be written does stop it: acting on events that are not
        durable would break the promise; a supervisor restarts the service."""
        try:
            fn(*args)
        except JournalError as e:
            self._journal_failed(e)
        except Exception:
            self._counters["driver_errors"] += 1
            log.exception("orchestrator: error while handling %s", fn.__name__)

    # ------------------------------------------------------------------ events
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
    def plan_now(self) -> list[Decision]:
        """Run the planner once now (on the driver thread) and apply its decisions;
        returns them. The driver also runs it every ``planner.interval``."""
        return self._call(self._plan)

    def use_planner(self, planner: Planner, provisioner: Provisioner | None = None) -> None:
        """Run ``planner`` from now on (its first call one ``planner.interval`` from
        now), with ``provisioner`` (``None``: keep the current one). The window of
        history carries over."""

        def use() -> None:
            self._elastic.use(planner, provisioner, self._now())

        self._call(use)

    def _plan(self) -> list[Decision]:
        assert self._core is not None
        return self._elastic.step(self._core.snapshot(), self._now(), self._planner_feed)

    def _planner_feed(self, ev: Event) -> list[Action]:
        try:
            return self._feed(ev, None)
        except RequestRejected as e:  # the actions ran; only the refusal matters here
            return [Rejected(e.code, e.reason, type(ev).__name__)]  # type: ignore[arg-type]

    def _table_submitted(self, ev: Submit) -> None:
        self.table.submitted(ev.request_id, ev.slo_class or self.config.orchestrator.default_class)

    def _replayed(self, event: Event, actions: list[Action]) -> None:
        """Journal recovery: rebuild statuses and who produced what (nothing is sent)."""
        if isinstance(event, Submit) and not any(isinstance(a, Rejected) for a in actions):
            self._table_submitted(event)
        if isinstance(event, ItemDone) and event.output:
            self._producers.setdefault(event.request_id, set()).add(event.worker_id)
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
            self._resumable_of(a)
            if isinstance(a, ReleasePayloads):
                producers = self._producers.pop(a.request_id, None)
                if producers:  # sent before the restart; maybe lost with it
                    self._redeliver[a.request_id] = producers
                    while len(self._redeliver) > _REDELIVER:
                        self._redeliver.popitem(last=False)

    def _execute(self, a: Action, ident: bytes | None) -> None:
        self.table.apply(a)
        resumable = self._resumable_of(a)
        if resumable is not None:
            self._forget_resumable(*resumable)
        if isinstance(a, Dispatch):
            self._counters[f"dispatched:{a.item.stage}"] += 1
            self._observe_dispatch(a.item.request_id, a.item.stage)
            self._send_work(a)
        elif isinstance(a, Revoke):
            ref = ItemRef(a.request_id, a.stage, a.attempt)
            self._forget(ref)
            self._send(a.worker_id.encode(), Drop(ref, a.reason))
        elif isinstance(a, Preempt):
            ref = ItemRef(a.request_id, a.stage, a.attempt)
            self._counters["preemptions"] += 1
            self.table.preempted(ref, a.worker_id, a.reason)
            self._send(a.worker_id.encode(), Yield(ref, a.reason))
        elif isinstance(a, Requeued):
            self._counters[f"requeued:{a.stage}"] += 1
            self._forget(ItemRef(a.request_id, a.stage, a.attempt))
        elif isinstance(a, Rerun):
            self._counters[f"rerun:{a.stage}"] += 1
            log.warning("orchestrator: %s: %s runs again: %s", a.request_id, a.stage, a.reason)
        elif isinstance(a, ReleasePayloads):
            self._release(a.request_id)
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
            for ref in list(self._outstanding_of.get(a.worker_id, ())):
                self._forget(ref)  # re-queued (a new attempt) or failed: nothing to resend
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

    def _orphaned(self, rid: str, wid: str) -> None:
        """``wid`` published an output whose result was refused (a stale attempt, or a
        worker the service had given up on): nobody will consume it. Have it dropped
        when the request ends, or now if it already has."""
        st = self.table.status(rid)
        if st is not None and st.state not in TERMINAL:
            self._producers.setdefault(rid, set()).add(wid)
        else:
            self._send(wid.encode(), Release(rid))

    def _release(self, rid: str) -> None:
        """Ask the producers of ``rid``'s outputs to drop them. If none is alive, any
        live worker will do: in store mode its ``cleanup`` removes the request's
        objects whoever stored them (p2p payloads died with their producer)."""
        producers = self._producers.pop(rid, set())
        if not producers:
            return
        assert self._core is not None
        is_live = self._core.is_live
        targets = {w for w in producers if is_live(w)}
        if not targets:  # rare: O(workers) only here, not per request
            targets = set(sorted(self._core.live_workers())[:1])
        for wid in targets:
            self._send(wid.encode(), Release(rid))

    def _resumable_of(self, a: Action) -> tuple[str, WorkItem] | None:
        """Track each live request's last denoise dispatch; when the request ends
        failed or cancelled, forget it and return it (completed: its checkpoints are
        gone already)."""
        if isinstance(a, Dispatch) and a.item.stage == "denoise":
            self._resumable[a.item.request_id] = (a.worker_id, a.item)
        elif isinstance(a, RequestCompleted | RequestFailed | RequestCancelled):
            last = self._resumable.pop(a.request_id, None)
            return None if isinstance(a, RequestCompleted) else last
        return None

    def _forget_resumable(self, wid: str, item: WorkItem) -> None:
        """Have ``item``'s worker, or another live worker of its stage, drop what would
        resume it (a ``Release`` carrying the item)."""
        assert self._core is not None
        live = [w.worker_id for w in self._core.snapshot().workers if item.stage in w.stages]
        target = wid if wid in live else next(iter(live), None)
        if target is None:
            log.info(
                "orchestrator: %s: no %s worker to drop its checkpoints",
                item.request_id,
                item.stage,
            )
            return
        self._send(target.encode(), Release(item.request_id, item))

    def _send_work(self, d: Dispatch) -> None:
        it = d.item
        frame = encode(Work(it))
        ref = ItemRef(it.request_id, it.stage, it.attempt)
        self._forget(ref)
        self._outstanding[ref] = _Outstanding(d.worker_id, frame, time.monotonic())
        self._outstanding_of.setdefault(d.worker_id, set()).add(ref)
        self._send_frame(d.worker_id.encode(), frame)

    def _forget(self, ref: ItemRef) -> None:
        out = self._outstanding.pop(ref, None)
        if out is not None:
            refs = self._outstanding_of[out.worker_id]
            refs.discard(ref)
            if not refs:
                del self._outstanding_of[out.worker_id]

    def _send(self, ident: bytes, msg: Any) -> None:
        self._send_frame(ident, encode(msg))

    def _send_frame(self, ident: bytes, frame: bytes) -> None:
        if self._frames is not None:  # inside a turn: sent once its events are durable
            self._frames.append((ident, frame))
        else:
            self._push_frame(ident, frame)

    def _push_frame(self, ident: bytes, frame: bytes) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError:  # not connected (yet), or its queue is full: Beat recovers
            self._counters["send_failures"] += 1

    # ------------------------------------------------------------------ worker frames
    def _on_worker_frame(self, msg: list[bytes]) -> None:
        """One message off the ROUTER socket: a worker's frame, or a foreign peer's
        message of another shape (counted, dropped)."""
        if len(msg) != 2:
            self._counters["wire_errors"] += 1
            return
        self._guard(self._on_frame, msg[0], msg[1])

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = decode_from_worker(frame)
        except WireError as e:
            self._counters["wire_errors"] += 1
            log.warning("orchestrator: bad frame from %r: %s", ident[:64], e)
            self._send(ident, Refused("bad_message", str(e), "frame"))
            return
        if msg.worker_id.encode() != ident:
            self._send(ident, Refused("bad_value", "worker_id must be the routing id", "frame"))
            return
        if isinstance(msg, Hello):
            self._on_hello(ident, msg)
            if self._redeliver and (not self.config.token or ident in self._authed):
                self._redeliver_to(msg.worker_id)
            return
        if self.config.token:
            key = self._authed.get(ident)
            if key is None or not hmac.compare_digest(msg.session.encode(), key.encode()):
                self._counters["unauthorized"] += 1
                self._send(
                    ident, Refused("unauthorized", "say Hello with the token first", "frame")
                )
                return
            self._authed.move_to_end(ident)  # the least recently heard go first when many
        wid = msg.worker_id
        if self._redeliver:
            self._redeliver_to(wid)
        if isinstance(msg, Beat):
            acts = self._feed(Heartbeat(wid, msg.credits), ident)
            if msg.memory is not None and not _rejected(acts, "Heartbeat"):
                self._memory[wid] = msg.memory  # a live worker's: dropped when it is removed
            self._resend_missing(wid, set(msg.running))
        elif isinstance(msg, Done):
            r, info = msg.item, msg.info

            def tell() -> None:  # only a result the core took reaches the client
                self.table.done(r, wid, info)
                self._observe_done(r.request_id, r.stage, info)

            ev = ItemDone(wid, r.request_id, r.stage, r.attempt, msg.output)
            acts = self._feed(ev, ident, accepted=tell)
            refused = _rejected_code(acts, "ItemDone")
            if refused in _ORPHANING and msg.output:
                self._orphaned(r.request_id, wid)
            if refused is None:
                self._forget(r)
                st = self.table.status(r.request_id)
                if msg.output and st is not None and st.state not in TERMINAL:
                    # an intermediate output: its producer drops it when the request ends
                    self._producers.setdefault(r.request_id, set()).add(wid)
        elif isinstance(msg, Failed):
            r = msg.item
            ev = ItemFailed(
                wid, r.request_id, r.stage, r.attempt, msg.reason, msg.retryable, msg.input_lost
            )
            if not _rejected(self._feed(ev, ident), "ItemFailed"):
                self._forget(r)
        elif isinstance(msg, Yielded):
            r = msg.item
            ev = ItemYielded(wid, r.request_id, r.stage, r.attempt)
            if not _rejected(self._feed(ev, ident), "ItemYielded"):
                self._forget(r)
                self.table.yielded(r, wid)
        elif isinstance(msg, Progress):
            self.table.progress(msg.item, wid, msg.step, msg.total)
        elif isinstance(msg, Leave):
            self._feed(Drain(wid, msg.reason), ident)
        elif isinstance(msg, Bye):
            self._authed.pop(ident, None)
            assert self._core is not None
            if self._core.is_live(wid):  # else drained and removed already
                self._feed(WorkerLost(wid, msg.reason), ident)

    def _on_hello(self, ident: bytes, msg: Hello) -> None:
        token = self.config.token
        if token and not hmac.compare_digest(msg.token.encode(), token.encode()):
            self._counters["unauthorized"] += 1
            self._send(ident, Refused("unauthorized", "wrong or missing token", "Hello"))
            return
        # a key per connection that proved the token, kept across its Hellos (a stage
        # change says Hello again while its beats with the key are under way)
        session = self._authed.setdefault(ident, secrets.token_hex(16)) if token else ""
        if token:  # kept until its Bye (a removed worker's late Done is answered, not
            self._authed.move_to_end(ident)  # refused); the least recently heard go
            while len(self._authed) > _MAX_SESSIONS:
                self._authed.popitem(last=False)
        assert self._core is not None
        wid = msg.worker_id
        known = self._core.is_live(wid)
        # only the Hello a Load asked for says how long loading took: another (a re-Hello
        # after a refusal or a new leader, while still loading) must not register the
        # stages it still holds as the new ones
        loaded = self._loading.get(wid) if known and msg.load_s is not None else None
        if known and msg.fresh and loaded is None:  # a new process under an old id:
            self._feed(WorkerLost(wid, "worker restarted"), ident)  # its items go back
            known = False
        if known and loaded is None:  # re-authenticating after a service restart
            acts = self._feed(Heartbeat(wid, msg.credits), ident)
        else:  # a new worker, or one that loaded the stages of a Load (LoadStages)
            stages = tuple(msg.stages)
            reg = RegisterWorker(
                wid, msg.stage, msg.credits, dict(msg.labels), msg.heartbeat_timeout, stages
            )
            acts = self._feed(reg, ident)
        if _rejected(acts, "RegisterWorker") or _rejected(acts, "Heartbeat"):
            return
        if loaded is not None:
            self._stage_changed(wid, tuple(msg.stages) or (msg.stage,), loaded, msg.load_s)
        timeout = msg.heartbeat_timeout or self.config.orchestrator.heartbeat_timeout
        self._send(ident, Welcome(msg.worker_id, timeout / 4, session))

    def _stage_changed(
        self,
        wid: str,
        stages: tuple[str, ...],
        asked: tuple[tuple[str, ...], str, float],
        load_s: float | None,
    ) -> None:
        """``wid`` registered again after a ``Load``: log and keep the change."""
        self._loading.pop(wid, None)
        want, reason, since = asked
        before = self._before.pop(wid, ())
        took = time.monotonic() - since
        change = {
            "worker_id": wid,
            "stages": list(stages),
            "before": list(before),
            "asked": list(want),
            "reason": reason,
            "load_s": load_s,
            "s": round(took, 3),  # Load sent -> registered again
            "line": f"{wid} {'+'.join(before) or '?'} -> {'+'.join(stages)} in {took:.2f} s"
            + ("" if load_s is None else f", model load {load_s:.2f} s")
            + f" ({reason})",
        }
        self.stage_changes.append(change)
        self.metrics.stage_change_seconds.observe(took)
        if load_s is not None:
            self.metrics.stage_load_seconds.observe(load_s)
        load = "?" if load_s is None else f"{load_s:.3f}"
        log.warning(
            "orchestrator: stage change done: worker %s serves %s (loaded in %s s)",
            wid,
            "+".join(stages),
            load,
        )

    def _redeliver_to(self, wid: str) -> None:
        """Send ``wid`` the releases a restart may have lost that it is owed, and those
        whose producers are all gone (as ``_release`` picks any live worker then): it
        just spoke, so it can be routed to."""
        assert self._core is not None
        is_live = self._core.is_live
        for rid, owed in list(self._redeliver.items()):
            if wid not in owed and any(map(is_live, owed)):
                continue  # a live producer of its own will take it
            self._counters["releases_resent"] += 1
            self._send(wid.encode(), Release(rid))
            owed.discard(wid)
            if not any(map(is_live, owed)):
                del self._redeliver[rid]

    def _resend_missing(self, wid: str, running: set[ItemRef]) -> None:
        now = time.monotonic()
        for ref in self._outstanding_of.get(wid, ()):
            out = self._outstanding[ref]
            if ref not in running and now - out.sent_at >= self.config.resend_after_s:
                out.sent_at = now
                self._counters["resent"] += 1
                self._send_frame(wid.encode(), out.frame)

    # ------------------------------------------------------------------ views
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

    def _cluster_view(self) -> dict[str, Any]:
        assert self._core is not None
        snap = self._core.snapshot()
        now, hb = self._now(), self.config.orchestrator.heartbeat_timeout
        running = []
        for st in self.table.live():
            if st.state == "running":
                running.append(
                    {
                        "request_id": st.request_id,
                        "stage": st.stage,
                        "worker_id": st.worker_id,
                        "step": st.step,
                        "total": st.total,
                    }
                )
        return {
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "stage": w.stage,
                    "stages": list(w.stages),
                    "state": w.state,
                    "labels": w.labels,
                    "held": w.held,
                    "free": w.free,
                    "running": list(w.running),
                    "heartbeat_age_s": round(max(0.0, hb - (w.expires_at - now)), 3),
                    "memory": msgspec.structs.asdict(m)
                    if (m := self._memory.get(w.worker_id))
                    else None,
                }
                for w in snap.workers
            ],
            "queued": {s: list(q) for s, q in snap.queued.items()},
            "running": running,
            "free_credits": snap.free_credits,
            "decode_reserved": snap.decode_reserved,
            "counters": {**self._elastic.counts, **self._counters},
            "recent": [st.request_id for st in self.table.recent(_RECENT)],
            "stage_changes": list(self.stage_changes),
            "pools": pool_sizes(snap),
            "changing": [c.line() for _, c in sorted(self._elastic.pending.items())],
        }

    def _metrics(self) -> str:
        assert self._core is not None
        snap = self._core.snapshot()
        now, hb = self._now(), self.config.orchestrator.heartbeat_timeout
        self.metrics.sync({**self._elastic.counts, **self._counters})
        self.metrics.pool_workers_set(pool_sizes(snap))
        self.metrics.refresh(
            snap.queued,
            [
                (w.worker_id, w.stage, w.held, max(0.0, hb - (w.expires_at - now)))
                for w in snap.workers
            ],
            snap.free_credits,
            snap.decode_reserved,
        )
        self.metrics.memory_set(  # live workers' only: an entry goes with WorkerRemoved
            (wid, m.registered_bytes, m.pool_bytes_in_use, m.late_write_bytes)
            for wid, m in self._memory.items()
        )
        return self.metrics.text()


def take_frames(
    socket: zmq.Socket,
    handle: Callable[[list[bytes]], None],
    waiting: Callable[[], bool],
    limit: int,
) -> int:
    """Receive and ``handle`` up to ``limit`` messages from ``socket`` without
    blocking, stopping early when none is left or once ``waiting()`` is true after
    a message (an API call is posted: the turn takes it now and leaves the rest of
    the messages to the next turn). Returns how many were handled."""
    for n in range(limit):
        try:
            msg = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return n
        handle(msg)
        if waiting():
            return n + 1
    return limit


def _rejected(actions: list[Action], event: str) -> bool:
    return _rejected_code(actions, event) is not None


def _rejected_code(actions: list[Action], event: str) -> str | None:
    return next((a.code for a in actions if isinstance(a, Rejected) and a.event == event), None)


#: session keys kept (with a token); past it the least recently heard worker's goes
#: (a live one so dropped is refused once and says Hello again)
_MAX_SESSIONS = 65_536

#: refusals of a Done that leave its published output without a consumer
_ORPHANING = frozenset({"stale_attempt", "unknown_worker"})

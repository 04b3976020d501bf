"""The orchestrator as a running service: the core, a ZeroMQ worker channel and a client API.

Library mode (in-process, what engines embed) and the standalone command
(``mooncake-diffusion orchestrator``, which adds ``http/api.py``'s HTTP API) are the
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
ready at one poll, up to ``driver._TURN_FRAMES`` frames) is one journal transaction; the
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
releases of the last ``releases._REDELIVER`` requests that ended before it went down again,
each to its producer once that worker speaks to the new service (only then can it
be routed to); a producer that is gone hands its share to whichever worker speaks
next (in store mode any worker's cleanup removes a request's objects).
Releasing twice is safe: nothing is left to drop. A request that ends failed or
cancelled after a denoise attempt also has its step checkpoints dropped (nobody will
resume it): its last denoise item goes in a ``Release`` to the worker that ran it,
or to another live denoise worker (``worker.runtime.Resumable``); with none alive, they
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

Where the code is: this module is the lifecycle and the client API (``start``,
``run_on_loop``, ``close``, ``submit`` and the rest, each posted to the driver), and
the views the API reads (``cluster``, ``metrics_text``). ``OrchestratorService``'s
other methods come from its bases, one per seam, each docstring saying who calls
what: ``driver.DriverMixin`` (the loop, its turns, group commit, stall accounting),
``actions.ActionsMixin`` (an event through the core, its actions executed, the
journal's replay, the planner's round) and ``channel.ChannelMixin`` (the socket and
the worker frames). The state one seam alone keeps is a collaborator of its own:
``releases.Outstanding`` (the Work owed), ``releases.Releases`` (the releases owed)
and ``channel.Sessions`` (the token sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from collections import Counter, deque
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
    Cancel,
    Drain,
    Heartbeat,
    OrchestratorConfig,
    Reassign,
    Submit,
)
from mooncake_diffusion.orchestrator.core.routing import RoutingPolicy
from mooncake_diffusion.orchestrator.elastic.contract import Decision, Planner, Provisioner
from mooncake_diffusion.orchestrator.elastic.driver import Elastic, pool_sizes
from mooncake_diffusion.orchestrator.elastic.planners import create_planner
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.link.inbox import Inbox
from mooncake_diffusion.orchestrator.link.wire import Memory
from mooncake_diffusion.orchestrator.service.actions import ActionsMixin
from mooncake_diffusion.orchestrator.service.channel import ChannelMixin, Sessions
from mooncake_diffusion.orchestrator.service.driver import (
    DriverMixin,
    RequestRejected,
    ServiceUnavailable,
    take_frames,
)
from mooncake_diffusion.orchestrator.service.journal import (
    EventLog,
    Journal,
    JournaledOrchestrator,
)
from mooncake_diffusion.orchestrator.service.metrics import ServiceMetrics
from mooncake_diffusion.orchestrator.service.releases import Outstanding, Releases
from mooncake_diffusion.orchestrator.service.stalls import StallWatch
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
    "take_frames",
]

MAX_PARAMS_BYTES = 64 * 1024

#: Finished request ids ``cluster()`` lists (newest last), for dashboards.
_RECENT = 50


@dataclass(frozen=True)
class ServiceConfig:
    """``worker_bind``: the ZeroMQ endpoint workers connect to (port 0 picks a free
    one). ``journal``: a SQLite path, or None for no durability. ``token``: when
    set, workers must present it in ``Hello`` (the HTTP API checks it too); it is
    required when ``worker_bind`` is not loopback. ``resend_after_s``: see the
    module docstring. ``max_finished``: finished statuses kept for the API.
    ``planner``: the planner's registry name (``elastic/planners.py``; ``static`` changes
    nothing), built with ``planner_options``; ``planner_window``: seconds of
    history its views cover (``elastic.view.PlanWindow``)."""

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


class OrchestratorService(DriverMixin, ActionsMixin, ChannelMixin):
    """See the module docstring. ``clock``: default a ``StallClock`` (monotonic time
    less the driver's own stalls, which a ``StallWatch`` notices); ``policy``: a
    routing policy instance (default: ``config.orchestrator.policy``); ``planner``: a
    planner instance (default: ``config.planner``), run on the driver thread every
    ``planner.interval`` (``elastic.driver.Elastic``); ``provisioner``: where its
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
        #: the Work frames sent and not answered yet (resent when a Beat misses them)
        self._sent = Outstanding()
        #: with a token: the session key of each worker connection that proved it
        self._sessions = Sessions()
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
        #: who must drop which outputs and checkpoints; releases a restart may have lost
        self._releases = Releases(self.table, self._send, self._counters)
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
        ``config.journal`` names, or None (``ha.service`` gives its etcd journal)."""
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

    # ------------------------------------------------------------------ views
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

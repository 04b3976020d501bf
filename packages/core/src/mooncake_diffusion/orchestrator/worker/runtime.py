"""The worker runtime: a stage function served to the orchestrator.

    def denoise(item: WorkItem, ctx: StageContext) -> StagePayload | bytes:
        with ctx.connector.consume(item.input) as cond:   # the upstream output
            latent = run_dit(cond.tensors, ctx.params, on_step=ctx.progress)
        return StagePayload(request_id=item.request_id, kind="latent", tensor=latent)

    StageWorker("denoise", denoise, "tcp://127.0.0.1:7422", credits=1).run()

Call sequence: ``run()`` says Hello (with labels and credits), then loops:
items arrive as ``Work``; each runs ``fn(item, ctx)`` on one of ``credits``
threads. A returned ``StagePayload`` is published through the worker's
connector and acknowledged with its handle once ``Publication.wait`` returns
(so an acknowledged output is always consumable); returned ``bytes`` are
acknowledged as the output as they are (a final stage's small result). An
exception fails the item (``retryable`` unless it is a ``PayloadError`` or
``ValueError``: bad input fails the request at once). Every
``heartbeat_interval`` the worker sends a ``Beat`` listing what it holds, and
one more right before each Mooncake call of the process that keeps the GIL for
about a second (``_mooncake.gil``: a store client recycled after its store host
went away closes its old one), so that such a call cannot starve the beats past
the heartbeat timeout.

Obligations of ``fn``: idempotent per ``(request_id, stage)`` (an item may run
again after a worker death: at least once); check ``ctx.cancelled`` at natural
boundaries (a cancelled item's result is discarded and its publications
withdrawn); with preemption on, check ``ctx.should_yield`` at step boundaries
and stop (raise, or return ``None``) with its progress checkpointed; report
``ctx.progress(step, total)`` if it likes. A stage function that keeps state to
resume its items (the reference denoise: step checkpoints) may offer ``forget``
(``Resumable``): the worker calls it when the orchestrator says that an item's
request ended failed or cancelled, so that state goes too.

Several stages: ``extra_stages`` gives more ``{stage: fn}`` served by the same
credits (one GPU that holds several models); an item runs the function of its
stage. Stage changes: when the orchestrator moves the worker to other stages
(``Load``, sent once it holds nothing), a thread builds each new stage's
function with ``loader(stage)`` (loading its model; the beats go on meanwhile),
drops the others, and the worker says ``Hello`` again with the new stages and
the seconds the load took (``load_s``, which the service reports). Without a
``loader``, or if it raises, the worker keeps the stages it has and says so.

Shutdown: ``drain()`` (SIGTERM when ``run()`` is on the main thread) tells
the orchestrator it is leaving (``Leave``: the core's ``Drain``). Nothing more
is dispatched to it; its running denoise items are asked to yield at their next
step boundary (``Yield``: a stage that checkpoints resumes elsewhere from its
step checkpoint; one that does not check ``should_yield`` just finishes); other
running items finish and are acknowledged; an item that arrives meanwhile goes
back at once (``Yielded``: not a failed attempt). Once it holds nothing it says
``Bye`` and closes. A ``Retire`` from the orchestrator (it was drained by the
planner) is the same. ``stop()`` leaves without waiting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import msgspec
import zmq

from mooncake_diffusion._mooncake import gil
from mooncake_diffusion.errors import PayloadError
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.link.follow import Follower
from mooncake_diffusion.orchestrator.link.inbox import Inbox
from mooncake_diffusion.orchestrator.link.wire import (
    Beat,
    Bye,
    Done,
    Drop,
    Failed,
    Hello,
    Info,
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
    decode_from_service,
    encode,
)
from mooncake_diffusion.orchestrator.worker.lost_input import InputWatch
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import StagePayload

__all__ = ["Resumable", "StageContext", "StageFn", "StageLoader", "StageWorker"]

log = logging.getLogger("mooncake_diffusion.worker")
_REMEMBER_DONE = 256
#: how long a thread about to keep the GIL waits for the beat it asked for
_BEAT_WAIT_S = 0.5
#: how often the release thread looks at what the connector holds (sent with the beats)
_MEMORY_EVERY_S = 1.0


class StageContext:
    """What a stage function gets besides its item. ``info``: small facts it may set
    for the client's event stream (``bytes``, ``path``, ``cache_hit``). ``connector``
    is the worker's, watched (``lost_input.InputWatch``): if consuming the item's
    input finds it gone, the failure is reported with ``input_lost`` and the
    orchestrator re-runs the stage that produced it."""

    def __init__(self, worker: StageWorker, item: WorkItem) -> None:
        self.item = item
        self.worker_id = worker.worker_id
        self.labels = dict(worker.labels)
        self._watch = InputWatch(worker.connector, item.input)
        self.connector: Any = self._watch
        self.info: Info = {}
        self._worker = worker
        self._cancelled = threading.Event()
        self._yield = threading.Event()
        self._superseded = False
        self._params: Any = None

    @property
    def params(self) -> Any:
        """The request's params decoded as JSON (``{}`` when empty)."""
        if self._params is None:
            raw = self.item.params
            self._params = msgspec.json.decode(raw) if raw else {}
        return self._params

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def should_yield(self) -> bool:
        """The orchestrator asked this item to stop at its next step boundary (a job of a
        higher class waits). Stop, with progress checkpointed, by raising or returning
        ``None``: the item goes back to its queue (not a failure) and resumes later."""
        return self._yield.is_set()

    def progress(self, step: float, total: float) -> None:
        """Report progress (thread-safe, cheap; sent on the worker's next loop turn).
        Whole steps on the wire: a fraction is rounded down; a non-number raises here."""
        self._worker._post(("progress", _ref(self.item), int(step), int(total)))


StageFn = Callable[[WorkItem, StageContext], StagePayload | bytes | None]
#: ``loader(stage)``: load ``stage``'s model in this process and return its function
#: (blocks while loading; raises if it cannot)
StageLoader = Callable[[str], StageFn]


@runtime_checkable
class Resumable(Protocol):
    """A stage function with state that resumes its items (optional capability)."""

    def __call__(self, item: WorkItem, ctx: StageContext) -> StagePayload | bytes | None: ...

    def forget(self, item: WorkItem, ctx: StageContext) -> None:
        """Drop what would resume ``item``: its request ended failed or cancelled (any
        attempt of it, on any worker, may have left that state). Runs on the worker's
        release thread, after the request's payloads are dropped; ``ctx`` is a fresh
        context of ``item`` (its connector, no input consumed). Must tolerate nothing
        being there; an exception is logged."""
        ...


def _ref(item: WorkItem) -> ItemRef:
    return ItemRef(item.request_id, item.stage, item.attempt)


class StageWorker:
    """Serve ``fn`` for ``stage`` to the orchestrator at ``orchestrator`` (a ZeroMQ
    endpoint). ``extra_stages``: more stages and their functions, on the same
    credits; ``loader``: builds a stage's function on a stage change (module
    docstring); ``on_stage_change(stages, load_s)`` is called after one (e.g. to
    print it). ``connector``: one to publish and consume with (default: built from
    ``transfer_mode`` and ``settings``; either way the worker closes it at the end
    only if it built it). ``connect_timeout_s``: how long ``run()`` waits for the
    first ``Welcome`` before raising ``OrchestratorError``."""

    def __init__(
        self,
        stage: str,
        fn: StageFn,
        orchestrator: str,
        *,
        worker_id: str | None = None,
        credits: int = 1,
        labels: dict[str, str] | None = None,
        connector: DiffusionConnector | None = None,
        transfer_mode: str = "store",
        settings: Any = None,
        token: str | None = None,
        heartbeat_timeout: float | None = None,
        publish_timeout_s: float = 60.0,
        connect_timeout_s: float = 30.0,
        extra_stages: dict[str, StageFn] | None = None,
        loader: StageLoader | None = None,
        on_stage_change: Callable[[tuple[str, ...], float], None] | None = None,
    ) -> None:
        if credits < 1:
            raise OrchestratorError(f"credits must be >= 1, got {credits}")
        self.stage = stage
        self.fn = fn
        #: the function of every stage it holds, ``stage``'s first
        self.fns: dict[str, StageFn] = {stage: fn}
        for s, f in (extra_stages or {}).items():
            self.fns.setdefault(s, f)
        self.loader = loader
        self.on_stage_change = on_stage_change
        #: seconds each stage change's load took, in order (``Load``)
        self.load_seconds: list[float] = []
        self.orchestrator = orchestrator
        self.worker_id = worker_id or f"{stage}-{socket.gethostname()}-{os.getpid()}"
        self.credits = credits
        self.labels = dict(labels or {})
        self.labels.setdefault("node", socket.gethostname())
        self._own_connector = connector is None
        self.connector = connector or DiffusionConnector(stage, transfer_mode, settings)  # type: ignore[arg-type]
        self.token = token or os.environ.get("MCD_ORCHESTRATOR_TOKEN", "")
        self.heartbeat_timeout = heartbeat_timeout
        self.publish_timeout_s = publish_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._mail: Inbox[tuple[Any, ...]] = Inbox()
        self._running: dict[ItemRef, StageContext] = {}
        self._done: OrderedDict[ItemRef, Done] = OrderedDict()
        self._publish_lock = threading.Lock()
        #: publications of finished items, until their request is released (supersede)
        self._pubs: dict[ItemRef, Any] = {}
        self._draining = threading.Event()
        self._announced = False  # the orchestrator was told (Leave) or told us (Retire)
        self._loading: threading.Thread | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._welcomed = threading.Event()
        #: the key of the last Welcome, stamped on every later message (with a token)
        self._session = ""
        self._serving: int | None = None  # the serve loop's thread id, while it runs
        #: ``_cleanup``'s requests: (request id, the item to ``forget`` or None)
        self._releases: queue.SimpleQueue[tuple[str, WorkItem | None] | None] = queue.SimpleQueue()
        self.items_done = 0
        self.items_failed = 0
        #: what the connector held at the release thread's last look (``Beat.memory``)
        self._memory: Memory | None = None
        self._look_failed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> StageWorker:
        """Run in a background thread; returns once the orchestrator welcomed us."""
        self._thread = threading.Thread(target=self._run_safely, name=f"mcd-{self.worker_id}")
        self._thread.start()
        if not self._welcomed.wait(self.connect_timeout_s + 1):
            self.stop()
            raise OrchestratorError(
                f"no orchestrator answered at {self.orchestrator} within {self.connect_timeout_s} s"
            )
        return self

    def _run_safely(self) -> None:
        with contextlib.suppress(OrchestratorError):
            self.run(install_signal_handlers=False)

    @property
    def stages(self) -> tuple[str, ...]:
        """Every stage it holds now, ``stage`` first."""
        return tuple(self.fns)

    def drain(self) -> None:
        """Leave: denoise items yield at a step boundary, others finish, nothing new is
        taken (module docstring). Thread- and signal-safe; returns at once."""
        self._draining.set()
        self._mail.wake()

    def stop(self, timeout: float = 30.0) -> None:
        """Leave now (running items are abandoned: the orchestrator re-queues them)."""
        self._stop.set()
        self._mail.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _post(self, msg: tuple[Any, ...]) -> None:
        self._mail.put(msg)

    # ------------------------------------------------------------------ the loop
    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Serve until drained or stopped. Raises ``OrchestratorError`` if the
        orchestrator never answers or refuses us (a wrong token, a bad stage)."""
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.drain())
            signal.signal(signal.SIGINT, lambda *_: self.drain())
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.ROUTING_ID, self.worker_id.encode())
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        # a tcp:// endpoint, or etcd://...: the announced leader, followed (link/follow.py)
        self._follow = Follower(self.orchestrator, wake=self._mail.wake)
        self._follow.sync(sock)
        pool = ThreadPoolExecutor(self.credits, thread_name_prefix=f"mcd-{self.worker_id}")
        # store calls of releases, off the loop: a dead master holds one for seconds.
        # Started now, not at the first release: a worker's threads are all there once
        # it serves (the chaos tier's baselines count them)
        cleaner = threading.Thread(target=self._clean, name=f"mcd-{self.stage}-release")
        cleaner.start()
        self._serving = threading.get_ident()
        gil.listen(self._beat_now)
        try:
            self._serve(sock, pool)
        finally:
            gil.unlisten(self._beat_now)
            self._serving = None
            if self._loading is not None:
                self._loading.join()
            for c in self._running.values():
                c._cancelled.set()
            pool.shutdown(wait=True, cancel_futures=True)
            self._releases.put(None)
            cleaner.join()  # every release asked for is done
            self._follow.close()
            sock.close()
            ctx.term()
            if self._own_connector:
                self.connector.close()
            self._mail.close()

    def _beat_now(self) -> None:
        """``gil`` listener: have the serve loop send a beat now and wait (briefly) until
        it did; the call that follows may keep every thread still for a second. Not
        from the serve loop itself (it beats on its next turn, after the call)."""
        if self._serving is None or threading.get_ident() == self._serving:
            return
        sent = threading.Event()
        self._post(("beat", sent))
        sent.wait(_BEAT_WAIT_S)

    def _serve(self, sock: zmq.Socket, pool: ThreadPoolExecutor) -> None:
        def send(msg: Any) -> None:  # a message (with a token, stamped with the session key)
            if self._session and not isinstance(msg, Hello):
                msg = msgspec.structs.replace(msg, session=self._session)
            sock.send(encode(msg))

        hello = self._hello(fresh=True)
        if self._follow.address is not None:  # else sent once a leader is announced
            send(hello)
        started = time.monotonic()
        interval = 1.0
        next_beat = started + interval
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._mail.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            if self._follow.sync(sock):  # another orchestrator leads: introduce ourselves
                log.warning(
                    "worker %s: following the leader to %s", self.worker_id, sock.LAST_ENDPOINT
                )
                send(self._hello(fresh=False))
            now = time.monotonic()
            if not self._welcomed.is_set() and now - started > self.connect_timeout_s:
                raise OrchestratorError(
                    f"no orchestrator answered at {self.orchestrator} within "
                    f"{self.connect_timeout_s} s"
                )
            ready = dict(poller.poll(max(0.0, next_beat - now) * 1000))
            if self._draining.is_set() and not self._announced and self._welcomed.is_set():
                # before any frame is read: an item that arrives from now on goes back
                send(Leave(self.worker_id, "worker leaving (SIGTERM)"))
                self._announced = True
            if sock in ready:
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self._on_frame(frame, pool)
                    if isinstance(reply, Welcome):
                        interval = reply.heartbeat_interval
                    elif reply is not None:
                        send(reply)
            beat_asked: list[threading.Event] = []
            for msg in self._mail.drain():
                if msg[0] == "beat":
                    beat_asked.append(msg[1])
                elif msg[0] == "loaded":
                    self._loading = None
                    hello = self._hello(fresh=False, load_s=msg[1])
                    send(hello)  # again each beat until welcomed (a copy is a heartbeat)
                    self._welcomed.clear()
                    started = time.monotonic()
                else:
                    self._on_mail(msg, send)
            if self._announced and not self._running and self._loading is None:
                send(Bye(self.worker_id, "drained"))
                return
            now = time.monotonic()
            if beat_asked or now >= next_beat:
                if self._welcomed.is_set():
                    send(Beat(self.worker_id, self._refs(), memory=self._memory))
                    late = now - next_beat
                    if late > interval:  # the orchestrator may have given up on us
                        log.warning(
                            "worker %s: heartbeat %.1f s late (every %.1f s): this "
                            "process did not run its loop meanwhile",
                            self.worker_id,
                            late,
                            interval,
                        )
                elif self._follow.address is not None:
                    send(hello)  # the orchestrator may not have been up yet
                next_beat = now + interval
                for sent in beat_asked:
                    sent.set()

    def _hello(self, *, fresh: bool, load_s: float | None = None) -> Hello:
        stages = self.stages
        return Hello(
            self.worker_id,
            stages[0],
            self.credits,
            self.labels,
            self.heartbeat_timeout,
            self.token,
            fresh=fresh,
            stages=stages,
            load_s=load_s,
        )

    def _refs(self) -> tuple[ItemRef, ...]:
        return tuple(self._running)

    def _on_frame(self, frame: bytes, pool: ThreadPoolExecutor) -> Any:
        try:
            msg = decode_from_service(frame)
        except WireError as e:
            log.warning("worker %s: bad frame from the orchestrator: %s", self.worker_id, e)
            return None
        if isinstance(msg, Welcome):
            self._session = msg.session  # this connection's key ("" without a token)
            self._welcomed.set()
            return msg
        if isinstance(msg, Work):
            return self._on_work(msg.item, pool)
        if isinstance(msg, Drop):
            c = self._running.get(msg.item)
            if c is not None:
                c._cancelled.set()
            return None
        if isinstance(msg, Yield):
            c = self._running.get(msg.item)
            if c is not None:
                c._yield.set()
            return None
        if isinstance(msg, Release):
            if not any(r.request_id == msg.request_id for r in self._running):
                self._cleanup(msg.request_id, msg.item)
                for r in [r for r in self._pubs if r.request_id == msg.request_id]:
                    del self._pubs[r]
            return None
        if isinstance(msg, Load):
            self._load(tuple(msg.stages), msg.reason)
            return None
        if isinstance(msg, Retire):
            log.info("worker %s: retired: %s", self.worker_id, msg.reason)
            self._announced = True  # drained by the orchestrator: nothing to tell it
            self._draining.set()
            return None
        if isinstance(msg, Refused):
            return self._on_refused(msg)
        return None

    def _load(self, stages: tuple[str, ...], reason: str) -> None:
        """A stage change: load ``stages`` on a thread of its own (the loop beats on
        meanwhile), then say Hello with them (module docstring)."""
        if self._loading is not None or self._running:
            log.warning("worker %s: Load %s while busy: ignored", self.worker_id, stages)
            return
        log.info("worker %s: loading %s (%s)", self.worker_id, "+".join(stages), reason)
        t = threading.Thread(
            target=self._load_stages, args=(stages,), name=f"mcd-load-{self.worker_id}"
        )
        self._loading = t
        t.start()

    def _load_stages(self, stages: tuple[str, ...]) -> None:
        t0 = time.perf_counter()
        try:
            if self.loader is None:
                raise OrchestratorError("this worker has no loader for other stages")
            fns = {s: self.fns[s] if s in self.fns else self.loader(s) for s in stages}
        except Exception as e:  # keep what it holds; the orchestrator learns it from Hello
            log.warning("worker %s: cannot load %s: %s", self.worker_id, stages, e)
            fns = dict(self.fns)
        load_s = time.perf_counter() - t0
        self.fns = fns
        self.stage, self.fn = next(iter(fns.items()))
        self.load_seconds.append(load_s)
        log.info("worker %s: holds %s, loaded in %.3f s", self.worker_id, "+".join(fns), load_s)
        if self.on_stage_change is not None:
            self.on_stage_change(self.stages, load_s)
        self._post(("loaded", load_s))

    def _on_refused(self, msg: Refused) -> Any:
        if self._announced and msg.code == "unknown_worker":
            return None  # leaving, and the orchestrator has forgotten us already: fine
        if msg.code in ("unknown_worker", "unauthorized") and msg.about != "Hello":
            # the orchestrator forgot us (restarted without a journal, or re-auth needed)
            return self._hello(fresh=False)
        if msg.about in ("Hello", "RegisterWorker"):
            self._stop.set()
            raise OrchestratorError(f"the orchestrator refused {self.worker_id}: {msg.reason}")
        log.info("worker %s: %s refused (%s): %s", self.worker_id, msg.about, msg.code, msg.reason)
        return None

    def _cleanup(self, request_id: str, forget: WorkItem | None = None) -> None:
        """Drop ``request_id``'s outputs (``connector.cleanup``), then, with ``forget``
        and a ``Resumable`` stage function, what would resume that item, on the release
        thread: in store mode these are calls to the master, which the loop (and its
        heartbeat) must not wait for. One thread, so releases run in the order they came."""
        self._releases.put((request_id, forget))

    def _clean(self) -> None:
        """The release thread: runs ``_cleanup``'s requests until ``None``, and every
        ``_MEMORY_EVERY_S`` between them notes what the connector holds, for the beats
        (here, not on the loop: a look takes the connector's locks, which a transfer
        may hold, and the loop's beats must not wait for them)."""
        looked = time.monotonic() - _MEMORY_EVERY_S
        while True:
            if time.monotonic() - looked >= _MEMORY_EVERY_S:
                looked = time.monotonic()
                self._look()
            try:
                job = self._releases.get(
                    timeout=max(0.0, looked + _MEMORY_EVERY_S - time.monotonic())
                )
            except queue.Empty:
                continue
            if job is None:
                return
            request_id, item = job
            try:
                self.connector.cleanup(request_id)
                fn = self.fns.get(item.stage) if item is not None else None
                if item is not None and isinstance(fn, Resumable):
                    fn.forget(item, StageContext(self, item))
            except Exception as e:  # nothing re-sends it: say what is left
                log.warning("worker %s: release of %s failed: %s", self.worker_id, request_id, e)

    def _look(self) -> None:
        """Note what the connector holds now (``_memory``, sent with the next beat). A
        look that fails leaves ``_memory`` None (the beats say nothing rather than
        something old) and is logged once per run of failures."""
        try:
            st = self.connector.stats()
        except Exception as e:
            if not self._look_failed:  # the first of a run of failures
                log.warning("worker %s: cannot read its connector's stats: %s", self.worker_id, e)
            self._memory, self._look_failed = None, True
            return
        self._look_failed = False
        late = st.pool_bytes_quarantined + st.late_write_kept_bytes
        held = Memory(st.registered_bytes, st.pool_bytes_in_use, late, st.live_publications)
        self._memory = held

    def _on_work(self, item: WorkItem, pool: ThreadPoolExecutor) -> Any:
        ref = _ref(item)
        if ref in self._running:
            return None  # a copy of what we run
        if ref in self._done:
            return self._done[ref]  # a copy of what we finished: say Done again
        if self._announced:  # leaving: it goes back, not a failed attempt
            return Yielded(self.worker_id, ref)
        if item.stage not in self.fns or self._loading is not None:
            return Failed(self.worker_id, ref, f"worker does not hold {item.stage}")
        self._supersede(ref)
        ctx = StageContext(self, item)
        self._running[ref] = ctx
        pool.submit(self._execute, ctx)
        return None

    def _supersede(self, ref: ItemRef) -> None:
        """A newer attempt of a (request, stage) this worker already ran or runs: the
        orchestrator gave up on the older one (e.g. this worker was cut off past its
        heartbeat deadline) and will refuse its result. Drop what the older attempt
        published (its connector publication would collide with the new attempt's
        output; only its own: the request's other payloads, e.g. this stage's input,
        stay) and stop an older attempt that still runs; it publishes nothing."""
        older = [
            r
            for r in (*self._done, *self._running)
            if r.request_id == ref.request_id and r.stage == ref.stage and r.attempt < ref.attempt
        ]
        if not older:
            return
        log.info("worker %s: %s supersedes %s", self.worker_id, ref, older)
        with self._publish_lock:  # an older attempt publishes before this, or never
            for r in older:
                self._done.pop(r, None)
                ctx = self._running.get(r)
                if ctx is not None:
                    ctx._superseded = True
                    ctx._cancelled.set()
                pub = self._pubs.pop(r, None)
                if pub is not None:
                    pub.release()

    def _execute(self, ctx: StageContext) -> None:
        ref = _ref(ctx.item)
        try:
            out = self.fns[ctx.item.stage](ctx.item, ctx)
            if out is None and ctx.should_yield:
                self._post(("yielded", ref))
                return
            if isinstance(out, StagePayload):
                with self._publish_lock:
                    if ctx._superseded:  # a newer attempt runs: its output is the one
                        self._post(("superseded", ref))
                        return
                    pub = self.connector.publish(out)
                    self._pubs[ref] = pub
                pub.wait(self.publish_timeout_s)
                output = pub.encode()
            else:
                output = bytes(out or b"")
            self._post(("done", ref, output, ctx.info))
        except Exception as e:  # the stage's failure is the item's, never the worker's
            if ctx.should_yield:  # stopped as asked (e.g. the pipeline's DenoisePreempted)
                self._post(("yielded", ref))
                return
            retryable = not isinstance(e, PayloadError | ValueError)
            lost = ctx._watch.lost
            why = " (its input is lost)" if lost else ""
            log.warning("worker %s: %s failed%s: %s", self.worker_id, ref, why, e)
            self._post(("failed", ref, f"{type(e).__name__}: {e}", retryable, lost))

    def _on_mail(self, msg: tuple[Any, ...], send: Callable[[Any], None]) -> None:
        kind, ref = msg[0], msg[1]
        if kind == "progress":
            if ref in self._running:
                send(Progress(self.worker_id, ref, msg[2], msg[3]))
            return
        ctx = self._running.pop(ref, None)
        if ctx is None or ctx._superseded:
            return
        if ctx.cancelled:  # revoked: nobody wants the output
            self._cleanup(ref.request_id)
            return
        if kind == "yielded":
            send(Yielded(self.worker_id, ref))
        elif kind == "done":
            done = Done(self.worker_id, ref, msg[2], msg[3])
            self._done[ref] = done  # said again (with the key of the time) if the item comes again
            while len(self._done) > _REMEMBER_DONE:
                self._pubs.pop(self._done.popitem(last=False)[0], None)
            self.items_done += 1
            send(done)
        else:
            self.items_failed += 1
            send(Failed(self.worker_id, ref, msg[2], msg[3], msg[4] if len(msg) > 4 else False))

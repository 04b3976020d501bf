"""The service's driver: the one thread (or asyncio loop turn) that owns the core, in turns.

``DriverMixin`` is a base of ``OrchestratorService`` (``service.py``), not a class
to use alone: a turn reads and writes the service's state all over (the core, the
mailbox, the ROUTER socket, the request table, the counters, the loop's timer),
which ``OrchestratorService.__init__`` sets and ``start`` / ``run_on_loop`` open.
The calls, in the order they happen:

    _run(opened)           the driver thread's body (``start`` starts it): opens the
                           core (``service._open_core``), answers ``opened``, then
      _loop(watch)         turns until stopped: polls the socket and the mailbox (the
                           only place it blocks, until the next heartbeat deadline or
                           planner round), then one ``_turn`` per wake-up
    _kick() / _loop_turn() instead, on an asyncio loop (``run_on_loop``): the socket's
      _arm(deadline)       and the mailbox's readers kick a turn, a timer brings the next
                           deadline's; a turn never waits for anything but its commit
    _turn()                one turn under one journal group commit: the frames it sends
                           (``channel._send_frame``), the API answers and the stream
                           events it makes are held, then go out in order once durable
      take_frames(...)     the worker frames ready, up to ``_TURN_FRAMES``
      _turn_rest(deadline) then the API calls posted (``_answer``), a ``Tick`` when the
                           heartbeat deadline came, the planner when it is due
      _guard(fn, ...)      worker traffic and timers: what fails is logged and counted; a
                           journal that fails stops the driver (``_journal_failed``)
    _count_stalls(...)     after a turn that ran long: out of the clock's time
    _driver_ended(watch)   once it turns no more: the watch and the journal released,
                           ``stopped`` set, the calls nobody will answer failed

All of it runs on the driver's thread (the loop's thread, on a loop). The errors
API callers get are defined here, where the driver raises them; ``service.py``
re-exports them: ``RequestRejected`` (an event the core refused, or a request it
does not know; nothing changed) and ``ServiceUnavailable`` (stopped, closed or not
answering; retryable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import zmq

from mooncake_diffusion.orchestrator.core.clock import StallClock
from mooncake_diffusion.orchestrator.core.model import Tick
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.service.journal import JournaledOrchestrator, JournalError
from mooncake_diffusion.orchestrator.service.stalls import STALL_S, StallWatch

__all__ = ["DriverMixin", "RequestRejected", "ServiceUnavailable", "take_frames"]

log = logging.getLogger("mooncake_diffusion.orchestrator")


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


class DriverMixin:
    """The driver loop and its turns, as methods of ``OrchestratorService`` (module
    docstring). It reads and writes the service's ``_core``, ``_clock``, ``_mail``,
    ``_router``, ``_elastic``, ``table``, ``_frames``, ``_answers``, ``_counters``, the
    loop state (``_aloop``, ``_local``, ``_kicked``, ``_timer``, ``_wake_at``,
    ``_watch``) and ``_stopping`` / ``failure`` / ``stopped``; it calls the channel's
    ``_on_worker_frame`` and ``_push_frame``, ``actions.py``'s ``_feed`` and ``_plan``,
    and ``service.py``'s ``_open_core`` and ``leave_loop``."""

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

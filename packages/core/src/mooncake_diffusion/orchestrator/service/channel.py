"""The worker channel: the ROUTER socket, the frames that leave on it and those that arrive.

``ChannelMixin`` is a base of ``OrchestratorService`` (``service.py``), not a class
to use alone: a worker's frame reads and writes the service's state all over (the
core through ``_feed``, the request table, stage changes, counters), and
``ha.service.LeaderService`` overrides ``_on_frame`` and ``_push_frame``. It owns
the socket, and the token sessions through ``Sessions``. The calls:

    _bind() / _unbind(router)  ``start`` and ``run_on_loop`` (``service.py``), on the
                               caller's thread before the driver runs; ``_unbind``
                               only after a start that failed
    _on_worker_frame(msg)      each message ``take_frames`` reads off the socket in a
      _on_frame(ident, frame)  turn (``driver.py``): decoded, checked (token session,
      _on_hello(ident, hello)  routing id), fed to the core; a bad one is ``Refused``
      _stage_changed(...)      a worker registered again after a ``Load``
      _resend_missing(...)     a ``Beat`` that does not list Work it was sent long ago
    _send(ident, msg)          any part of the service: a frame to a worker, held until
    _send_frame(ident, frame)  the turn's commit (``driver._turn``), else sent at once
    _send_work(dispatch)       a ``Work`` frame, owed (``releases.Outstanding``) until
                               the worker answers it
    _push_frame(ident, frame)  the turn's end: onto the socket, never blocking (a peer
                               not connected or a full queue is counted; Beats recover)

All of it runs on the driver's thread (``_bind`` / ``_unbind`` aside).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any

import zmq

from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Dispatch,
    Drain,
    Heartbeat,
    ItemDone,
    ItemFailed,
    ItemYielded,
    RegisterWorker,
    Rejected,
    WorkerLost,
)
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.link.wire import (
    Beat,
    Bye,
    Done,
    Failed,
    Hello,
    ItemRef,
    Leave,
    Progress,
    Refused,
    Welcome,
    WireError,
    Work,
    Yielded,
    decode_from_worker,
    encode,
)
from mooncake_diffusion.orchestrator.service.status import TERMINAL

__all__ = ["ChannelMixin", "Sessions"]

log = logging.getLogger("mooncake_diffusion.orchestrator")


class Sessions:
    """With a token: each worker connection that said Hello with it -> the session key
    its later frames must carry (a routing id alone can be taken over). A key is kept
    across the connection's Hellos and until its Bye (a removed worker's late Done is
    answered, not refused); past ``_MAX_SESSIONS`` the least recently heard goes.
    Owned by the channel; driver thread only."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, str] = OrderedDict()

    def __contains__(self, ident: object) -> bool:
        return ident in self._keys

    def open(self, ident: bytes) -> str:
        """A Hello with the token: the connection's key, new or the one it has (a stage
        change says Hello again while its beats with the key are under way)."""
        key = self._keys.setdefault(ident, secrets.token_hex(16))
        self._keys.move_to_end(ident)  # the least recently heard go first when many
        while len(self._keys) > _MAX_SESSIONS:
            self._keys.popitem(last=False)
        return key

    def admits(self, ident: bytes, session: str) -> bool:
        """Whether a frame of ``ident`` carrying ``session`` comes from the connection
        that proved the token (it is then the most recently heard)."""
        key = self._keys.get(ident)
        if key is None or not hmac.compare_digest(session.encode(), key.encode()):
            return False
        self._keys.move_to_end(ident)  # the least recently heard go first when many
        return True

    def close(self, ident: bytes) -> None:
        """The connection said Bye: its key goes."""
        self._keys.pop(ident, None)


class ChannelMixin:
    """The worker channel, as methods of ``OrchestratorService`` (module docstring).
    It owns ``_ctx``, ``_router``, ``worker_address`` and ``_sessions``; it reads and
    writes the service's ``_core`` (through ``_feed``), ``table``, ``metrics``,
    ``_counters``, ``_frames`` (a turn's held frames), ``_loading``, ``_before``,
    ``stage_changes``, ``_memory``, the Work owed (``_sent``) and the releases
    (``_releases``)."""

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

    def _send_work(self, d: Dispatch) -> None:
        """``d``'s ``Work`` frame, owed until its worker answers it (``_resend_missing``)."""
        it = d.item
        frame = encode(Work(it))
        ref = ItemRef(it.request_id, it.stage, it.attempt)
        self._sent.add(ref, d.worker_id, frame, time.monotonic())
        self._send_frame(d.worker_id.encode(), frame)

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
            owed = self._releases.redelivery_owed()
            if owed and (not self.config.token or ident in self._sessions):
                self._releases.redeliver_to(msg.worker_id, self._core)
            return
        if self.config.token and not self._sessions.admits(ident, msg.session):
            self._counters["unauthorized"] += 1
            self._send(ident, Refused("unauthorized", "say Hello with the token first", "frame"))
            return
        wid = msg.worker_id
        if self._releases.redelivery_owed():
            self._releases.redeliver_to(wid, self._core)
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
                self._releases.orphaned(r.request_id, wid)
            if refused is None:
                self._sent.forget(r)
                st = self.table.status(r.request_id)
                if msg.output and st is not None and st.state not in TERMINAL:
                    # an intermediate output: its producer drops it when the request ends
                    self._releases.produced(r.request_id, wid)
        elif isinstance(msg, Failed):
            r = msg.item
            ev = ItemFailed(
                wid, r.request_id, r.stage, r.attempt, msg.reason, msg.retryable, msg.input_lost
            )
            if not _rejected(self._feed(ev, ident), "ItemFailed"):
                self._sent.forget(r)
        elif isinstance(msg, Yielded):
            r = msg.item
            ev = ItemYielded(wid, r.request_id, r.stage, r.attempt)
            if not _rejected(self._feed(ev, ident), "ItemYielded"):
                self._sent.forget(r)
                self.table.yielded(r, wid)
        elif isinstance(msg, Progress):
            self.table.progress(msg.item, wid, msg.step, msg.total)
        elif isinstance(msg, Leave):
            self._feed(Drain(wid, msg.reason), ident)
        elif isinstance(msg, Bye):
            self._sessions.close(ident)
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
        session = self._sessions.open(ident) if token else ""
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

    def _resend_missing(self, wid: str, running: set[ItemRef]) -> None:
        """A ``Beat`` of ``wid`` listed ``running``: send again the Work it was sent
        ``config.resend_after_s`` ago or more and does not list (module docstring of
        ``service.py``: Delivery)."""
        now = time.monotonic()
        for frame in self._sent.due(wid, running, now, self.config.resend_after_s):
            self._counters["resent"] += 1
            self._send_frame(wid.encode(), frame)


def _rejected(actions: list[Action], event: str) -> bool:
    return _rejected_code(actions, event) is not None


def _rejected_code(actions: list[Action], event: str) -> str | None:
    return next((a.code for a in actions if isinstance(a, Rejected) and a.event == event), None)


#: session keys kept (with a token); past it the least recently heard worker's goes
#: (a live one so dropped is refused once and says Hello again)
_MAX_SESSIONS = 65_536

#: refusals of a Done that leave its published output without a consumer
_ORPHANING = frozenset({"stale_attempt", "unknown_worker"})

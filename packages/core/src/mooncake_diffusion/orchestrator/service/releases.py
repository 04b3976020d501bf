"""What the service still owes its workers: Work not answered yet, and Releases to send.

Two collaborators, each owned by one ``OrchestratorService`` and holding state no
other part of it keeps (``LeaderService`` also asks the service's ``Outstanding``
for all of a worker's items when it first reaches a new leader). Both run on the driver's thread
only and never block; ``Releases`` sends through the service's ``_send``, which
holds a frame until the turn's commit. The calls:

    sent = Outstanding()
    sent.add(ref, worker, frame, now)     channel._send_work: a Work frame went out
    sent.forget(ref)                      the worker answered it (Done, Failed,
                                          Yielded), or the core revoked or re-queued it
    sent.forget_worker(worker)            the core removed the worker (actions)
    sent.due(worker, running, now, after) a Beat: what it does not list, sent long ago,
                                          to send again (channel._resend_missing)

    rel = Releases(table, send, counters)
    rel.produced(rid, worker)             a Done whose intermediate output the worker
                                          keeps until the request ends (channel, replay)
    rel.orphaned(rid, worker)             a refused Done whose output nobody will take
    rel.resumable_of(action)              every action (actions._execute, _replayed)
    rel.forget_resumable(wid, item, core) a request failed or cancelled after denoise
    rel.release(rid, core)                ``ReleasePayloads`` (actions._execute)
    rel.replayed_release(rid)             the same in journal recovery: maybe lost
    rel.redeliver_to(worker, core)        a worker spoke to the restarted service

Why Releases can be lost and sent again, and why twice is safe: ``service.py``'s
module docstring (Delivery).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Dispatch,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    WorkItem,
)
from mooncake_diffusion.orchestrator.link.wire import ItemRef, Release
from mooncake_diffusion.orchestrator.service.journal import JournaledOrchestrator
from mooncake_diffusion.orchestrator.service.status import TERMINAL, RequestTable

__all__ = ["Outstanding", "Releases", "SentWork"]

log = logging.getLogger("mooncake_diffusion.orchestrator")

#: releases of the requests that ended last before a restart, sent again (module doc)
_REDELIVER = 64


class SentWork(msgspec.Struct):
    """A Work frame not answered yet: its worker, the frame (sent again as it is) and
    when it was last sent (``time.monotonic()``)."""

    worker_id: str
    frame: bytes
    sent_at: float


class Outstanding:
    """The Work frames sent and not answered yet, by item and by worker (module
    docstring). An item is in both maps or in neither."""

    def __init__(self) -> None:
        self.items: dict[ItemRef, SentWork] = {}
        #: the same, by worker
        self.by_worker: dict[str, set[ItemRef]] = {}

    def add(self, ref: ItemRef, worker_id: str, frame: bytes, now: float) -> None:
        """``frame`` (the Work of ``ref``) was sent to ``worker_id`` at ``now``; it
        replaces what was owed for ``ref``."""
        self.forget(ref)
        self.items[ref] = SentWork(worker_id, frame, now)
        self.by_worker.setdefault(worker_id, set()).add(ref)

    def forget(self, ref: ItemRef) -> None:
        """Nothing is owed for ``ref`` any more (nothing happens if nothing was)."""
        out = self.items.pop(ref, None)
        if out is not None:
            refs = self.by_worker[out.worker_id]
            refs.discard(ref)
            if not refs:
                del self.by_worker[out.worker_id]

    def forget_worker(self, worker_id: str) -> None:
        """The worker was removed: its items were re-queued (a new attempt) or failed,
        nothing of it is resent."""
        for ref in list(self.by_worker.get(worker_id, ())):
            self.forget(ref)

    def due(self, worker_id: str, running: set[ItemRef], now: float, after: float) -> list[bytes]:
        """The frames to send ``worker_id`` again: its items not in ``running`` (what
        its Beat lists) that were last sent ``after`` seconds before ``now`` or more.
        Each returned counts as sent at ``now``."""
        frames = []
        for ref in self.by_worker.get(worker_id, ()):
            out = self.items[ref]
            if ref not in running and now - out.sent_at >= after:
                out.sent_at = now
                frames.append(out.frame)
        return frames


class Releases:
    """Who must drop which request's outputs and checkpoints, and the releases a
    restart may have lost (module docstring). ``table``: the service's request table
    (read: has a request ended?); ``send(ident, msg)``: the service's ``_send``;
    ``counters``: the service's tallies (``releases_resent``). ``core`` arguments
    are the service's opened core (``Orchestrator`` or ``JournaledOrchestrator``)."""

    def __init__(
        self,
        table: RequestTable,
        send: Callable[[bytes, Any], None],
        counters: Counter[str],
    ) -> None:
        self._table = table
        self._send = send
        self._counters = counters
        #: request -> the workers that hold its published outputs (dropped when it ends)
        self._producers: dict[str, set[str]] = {}
        #: live request -> (worker, item) of its last denoise dispatch (``resumable_of``)
        self._resumable: dict[str, tuple[str, WorkItem]] = {}
        #: releases that may have been lost in a restart (filled by the journal's replay):
        #: request -> its producers still owed one
        self._redeliver: OrderedDict[str, set[str]] = OrderedDict()

    def produced(self, rid: str, wid: str) -> None:
        """``wid`` published an output of ``rid`` that is not its last: it drops it when
        the request ends (``release``)."""
        self._producers.setdefault(rid, set()).add(wid)

    def orphaned(self, rid: str, wid: str) -> None:
        """``wid`` published an output whose result was refused (a stale attempt, or a
        worker the service had given up on): nobody will consume it. Have it dropped
        when the request ends, or now if it already has."""
        st = self._table.status(rid)
        if st is not None and st.state not in TERMINAL:
            self._producers.setdefault(rid, set()).add(wid)
        else:
            self._send(wid.encode(), Release(rid))

    def release(self, rid: str, core: Orchestrator | JournaledOrchestrator | None) -> None:
        """Ask the producers of ``rid``'s outputs to drop them. If none is alive, any
        live worker will do: in store mode its ``cleanup`` removes the request's
        objects whoever stored them (p2p payloads died with their producer)."""
        producers = self._producers.pop(rid, set())
        if not producers:
            return
        assert core is not None
        is_live = core.is_live
        targets = {w for w in producers if is_live(w)}
        if not targets:  # rare: O(workers) only here, not per request
            targets = set(sorted(core.live_workers())[:1])
        for wid in targets:
            self._send(wid.encode(), Release(rid))

    def resumable_of(self, a: Action) -> tuple[str, WorkItem] | None:
        """Track each live request's last denoise dispatch; when the request ends
        failed or cancelled, forget it and return it (completed: its checkpoints are
        gone already)."""
        if isinstance(a, Dispatch) and a.item.stage == "denoise":
            self._resumable[a.item.request_id] = (a.worker_id, a.item)
        elif isinstance(a, RequestCompleted | RequestFailed | RequestCancelled):
            last = self._resumable.pop(a.request_id, None)
            return None if isinstance(a, RequestCompleted) else last
        return None

    def forget_resumable(
        self, wid: str, item: WorkItem, core: Orchestrator | JournaledOrchestrator | None
    ) -> None:
        """Have ``item``'s worker, or another live worker of its stage, drop what would
        resume it (a ``Release`` carrying the item)."""
        assert core is not None
        live = [w.worker_id for w in core.snapshot().workers if item.stage in w.stages]
        target = wid if wid in live else next(iter(live), None)
        if target is None:
            log.info(
                "orchestrator: %s: no %s worker to drop its checkpoints",
                item.request_id,
                item.stage,
            )
            return
        self._send(target.encode(), Release(item.request_id, item))

    def replayed_release(self, rid: str) -> None:
        """Journal recovery met ``rid``'s ``ReleasePayloads``: its release was sent
        before the restart, and may have been lost with it (``redeliver_to``)."""
        producers = self._producers.pop(rid, None)
        if producers:  # sent before the restart; maybe lost with it
            self._redeliver[rid] = producers
            while len(self._redeliver) > _REDELIVER:
                self._redeliver.popitem(last=False)

    def redelivery_owed(self) -> bool:
        """Whether a release a restart may have lost is still owed (cheap: the channel
        asks at every worker frame)."""
        return bool(self._redeliver)

    def redeliver_to(self, wid: str, core: Orchestrator | JournaledOrchestrator | None) -> None:
        """Send ``wid`` the releases a restart may have lost that it is owed, and those
        whose producers are all gone (as ``release`` picks any live worker then): it
        just spoke, so it can be routed to."""
        assert core is not None
        is_live = core.is_live
        for rid, owed in list(self._redeliver.items()):
            if wid not in owed and any(map(is_live, owed)):
                continue  # a live producer of its own will take it
            self._counters["releases_resent"] += 1
            self._send(wid.encode(), Release(rid))
            owed.discard(wid)
            if not any(map(is_live, owed)):
                del self._redeliver[rid]

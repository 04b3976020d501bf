"""Recycle Store clients once a store host (or the master with it) has gone away.

A Mooncake Store client keeps its Transfer Engine's TCP connections to each store
host it has talked to. When that host dies, Mooncake never closes its side: the
sockets stay in CLOSE-WAIT for the life of the process, and the client opens a new
pool to the host that replaces it (measured in ``docs/chaos.md``). Nothing fails
that could tell the client: the master hands out the new host's segment and the
calls succeed. The only way to close those sockets from our side is to tear the
client down and build a fresh one with the same config (``StoreClient.recycle``).

Calls, in order:
- ``watch(client, admin, interval_s)``: from ``StoreClient.__init__`` (pure clients,
  ``settings.store_watch_s`` > 0). One daemon thread per process and admin address
  (``mcd-store-watch``) asks the master every ``interval_s`` (two HTTP GETs:
  ``/metrics`` and ``/get_all_segments``); it starts with the first watched client,
  whose ``watch`` returns once the first listing is in: the baseline. (A watch that
  listed only after its first interval missed a master restarted within it, and
  the client kept its dead sockets.)
- Each tick reads the master's count of segment mounts (``/metrics``,
  ``master_mount_segment_requests_total``), then its segment list, names counted
  with repeats. Every watched client is recycled, in this thread, once the master
  lists at least one segment again, when:
  - a name it listed before is listed fewer times, or not at all (its store host
    died or left; a restarted master lists only the hosts that mounted again). A
    store host restarted on the same address (a pinned port, or a random one drawn
    again) is listed twice until the master expires the dead one;
  - the mount count grew by more than the new names explain: a segment was
    mounted under a name already listed, a restart on the same address that fell
    between two ticks (the two listings can overlap for under a second);
  - the mount count went back: the master restarted.
  A recycle that fails (the master is still down) is tried again on the next tick.
  A master without that metric is watched by its names alone.
- ``unwatch(client)``: from ``StoreClient.close``; the last one stops and joins the
  thread (so leak checks see no thread left over).
- At interpreter exit (an ``atexit`` hook, while every module is still whole) each
  watch still running is stopped and joined: a client left open to a finalizer is
  closed later, during teardown, when a daemon thread can no longer be joined (it
  never runs again) and this module's globals may read ``None``. Its clients stay
  open; ``unwatch`` finds nothing left.
A master that does not answer is skipped for that tick, never an error.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
from collections import Counter
from typing import Protocol

from mooncake_diffusion._mooncake.master import admin_get

__all__ = ["Recyclable", "unwatch", "watch"]

log = logging.getLogger("mooncake_diffusion.store")

_MOUNTS = re.compile(rb"^master_mount_segment_requests_total(?:\{[^}]*\})? +([0-9.eE+]+)\s*$", re.M)


class Recyclable(Protocol):
    def recycle(self, reason: str) -> bool:
        """Replace the native client; ``False`` when it could not (tried again later)."""
        ...


class _Watch:
    def __init__(self, admin: str, interval_s: float) -> None:
        self.admin = admin
        self.interval_s = interval_s
        #: each admin GET's bound (a tick makes two)
        self.get_timeout_s = max(0.5, interval_s)
        self.clients: dict[int, Recyclable] = {}
        self.pending: dict[int, Recyclable] = {}
        self.reason = ""
        self.known: Counter[str] | None = None  # names listed last tick, with repeats
        self.mounts: int | None = None  # the master's mount count last tick
        self.unseen = 0  # names listed before their mount was counted (read order)
        self.stop = threading.Event()
        #: set once the first listing was tried: the baseline a fault is seen against
        self.primed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mcd-store-watch", daemon=True)

    def _get(self, path: str) -> bytes | None:
        """The master admin's answer at ``path``; None when it does not answer."""
        try:
            return admin_get(self.admin, path, self.get_timeout_s)
        except (OSError, ValueError):
            return None

    def _mount_count(self) -> int | None:
        text = self._get("/metrics")
        m = _MOUNTS.search(text) if text is not None else None
        return int(float(m.group(1))) if m else None

    def _segments(self) -> Counter[str] | None:
        text = self._get("/get_all_segments")
        if text is None:
            return None
        return Counter(
            n for n in (x.strip() for x in text.decode(errors="replace").splitlines()) if n
        )

    def _listing(self) -> tuple[Counter[str], int | None] | None:
        """(names with repeats, mount count or None); None when the master does not
        answer. The count is read first, so a mount between the two reads shows as a
        name whose count comes a tick later (``unseen``), never the other way round."""
        mounts = self._mount_count()
        names = self._segments()
        return None if names is None else (names, mounts)

    def _replaced(self, now: Counter[str], mounts: int | None) -> str:
        """Why the clients must be recycled (see the module doc), or ``""``."""
        known, before = self.known, self.mounts
        if known is None:
            return ""
        gone = known - now
        if gone:
            return f"store segment(s) {sorted(gone)} gone from the master"
        if mounts is None or before is None:
            return ""
        if mounts < before:
            self.unseen = 0
            return "the master restarted (its segment mount count went back)"
        added = sum((now - known).values())
        unexplained = (mounts - before) - added - self.unseen
        self.unseen = max(0, -unexplained)
        if unexplained > 0:
            return "a store segment was mounted again under a name already listed"
        return ""

    def tick(self) -> None:
        """One listing; recycle the clients if a store host went (or some are pending)."""
        got = self._listing()
        if got is None:
            return
        now, mounts = got
        why = self._replaced(now, mounts)
        if why:
            with _lock:
                self.pending.update(self.clients)
            self.reason = why
        self.known = now
        if mounts is not None:
            self.mounts = mounts
        if not now:  # nowhere to connect yet: recycle once a store host is listed
            return
        with _lock:
            todo = list(self.pending.items())
        for key, client in todo:
            if self.stop.is_set():
                return
            try:
                done = client.recycle(self.reason)
            except Exception:  # never let the watch die: try again on the next tick
                log.exception("recycling a store client failed")
                done = False
            if done:
                with _lock:
                    self.pending.pop(key, None)

    def _run(self) -> None:
        try:
            self.tick()
        finally:
            self.primed.set()
        while not self.stop.wait(self.interval_s):
            self.tick()


_lock = threading.Lock()
_watches: dict[str, _Watch] = {}


def watch(client: Recyclable, admin: str, interval_s: float) -> None:
    """Recycle ``client`` whenever a store segment disappears from the master at
    ``admin``; polled every ``interval_s`` (the first client of an address sets it).
    Returns once the watch has listed the master's segments once (or found it not
    answering), so a fault right after, before the first interval ran out, is seen
    against what the client was created with."""
    with _lock:
        w = _watches.get(admin)
        if w is None:
            w = _watches[admin] = _Watch(admin, interval_s)
            w.thread.start()
        w.clients[id(client)] = client
    w.primed.wait(2 * w.get_timeout_s + 1.0)  # the first tick: two bounded GETs


def _stop_all() -> None:
    """Stop and join every watch (``atexit``: before the interpreter tears down)."""
    with _lock:
        stopped = list(_watches.values())
        _watches.clear()
    for w in stopped:
        w.stop.set()
    for w in stopped:
        w.thread.join()


atexit.register(_stop_all)


def unwatch(client: Recyclable) -> None:
    """Stop watching ``client`` (idempotent); the last client of a watch stops its
    thread and waits for it, unless called from that thread."""
    stopped = []
    with _lock:
        for admin, w in list(_watches.items()):
            w.clients.pop(id(client), None)
            w.pending.pop(id(client), None)
            if not w.clients:
                del _watches[admin]
                w.stop.set()
                stopped.append(w)
    for w in stopped:
        if w.thread is not threading.current_thread():
            w.thread.join()

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
  (``mcd-store-watch``) lists the master's segments every ``interval_s`` (one HTTP
  GET of ``/get_all_segments``); it starts with the first watched client.
- When a segment it listed before is no longer listed (its store host died or left;
  a restarted master lists only the hosts that mounted again), every watched client
  is recycled, in this thread, once the master lists at least one segment again. A
  recycle that fails (the master is still down) is tried again on the next tick.
- ``unwatch(client)``: from ``StoreClient.close``; the last one stops and joins the
  thread (so leak checks see no thread left over).
A master that does not answer is skipped for that tick, never an error.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from mooncake_diffusion._mooncake.master import admin_get

__all__ = ["Recyclable", "unwatch", "watch"]

log = logging.getLogger("mooncake_diffusion.store")


class Recyclable(Protocol):
    def recycle(self, reason: str) -> bool:
        """Replace the native client; ``False`` when it could not (tried again later)."""
        ...


class _Watch:
    def __init__(self, admin: str, interval_s: float) -> None:
        self.admin = admin
        self.interval_s = interval_s
        self.clients: dict[int, Recyclable] = {}
        self.pending: dict[int, Recyclable] = {}
        self.reason = ""
        self.known: set[str] | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mcd-store-watch", daemon=True)

    def _segments(self) -> set[str] | None:
        try:
            text = admin_get(self.admin, "/get_all_segments", max(0.5, self.interval_s))
        except (OSError, ValueError):
            return None
        return {line.strip() for line in text.decode(errors="replace").splitlines() if line}

    def tick(self) -> None:
        """One listing; recycle the clients if a segment went (or some are pending)."""
        now = self._segments()
        if now is None:
            return
        gone = (self.known or set()) - now
        if gone:
            with _lock:
                self.pending.update(self.clients)
            self.reason = f"store segment(s) {sorted(gone)} gone from the master"
        self.known = now
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
        while not self.stop.wait(self.interval_s):
            self.tick()


_lock = threading.Lock()
_watches: dict[str, _Watch] = {}


def watch(client: Recyclable, admin: str, interval_s: float) -> None:
    """Recycle ``client`` whenever a store segment disappears from the master at
    ``admin``; polled every ``interval_s`` (the first client of an address sets it)."""
    with _lock:
        w = _watches.get(admin)
        if w is None:
            w = _watches[admin] = _Watch(admin, interval_s)
            w.thread.start()
        w.clients[id(client)] = client


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

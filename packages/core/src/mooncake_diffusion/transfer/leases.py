"""Time-to-live for published payloads, and the reaper that enforces it.

A payload published with ``ttl_s`` carries ``expires_at`` (unix seconds) in
its handle, and in store mode the expiry is written into every object key:

    mcd/<request_id>/<kind>/<nonce>@<expires_ms>/<tensor>.<chunk>

so any process that can list the store's keys can tell what is abandoned by
the key alone, without asking the producer (who may be dead). Objects whose
name is fixed by someone else (mailbox records, found by name) get a one-byte
marker beside them instead, whose key carries the expiry and the object's key:

    mcd-ttl/<expires_ms>/<key>    or    mcd-ttl/<expires_ms>.<tag>/<key>

(the tag, hex digits, tells apart the markers several writers put beside one
key with the same expiry), and an expired marker takes its object with it. The store host
of ``LocalCluster`` runs ``Reaper`` for its pool; a deployment runs one next
to its store hosts. Consumers treat an expired handle as gone whether or not
the reaper has come by yet. Clocks are assumed synchronised (NTP) to well
under a TTL.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

from mooncake_diffusion._mooncake.master import admin_get
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.platform.settings import MooncakeSettings

_log = logging.getLogger("mooncake_diffusion.leases")

__all__ = ["TTL_ROOT", "Reaper", "expired_keys", "expiry_of", "ttl_marker"]

#: Where expiry markers of fixed-name objects live.
TTL_ROOT = "mcd-ttl/"
_EXPIRY = re.compile(r"^mcd/[^/]+/[^/]+/[^/@]+@(\d+)/")
_MARKER = re.compile(r"^" + re.escape(TTL_ROOT) + r"(\d+)(?:\.[0-9a-f]+)?/(.+)$", re.DOTALL)
#: At most this many objects removed by one sweep (the rest wait for the next one).
SWEEP_BUDGET = 4096


def ttl_marker(expires_ms: int, key: str, tag: str = "") -> str:
    """The marker key saying that ``key`` expires at ``expires_ms`` (unix ms);
    ``tag`` (hex digits) makes it the writer's own beside others' of one key."""
    return f"{TTL_ROOT}{expires_ms}.{tag}/{key}" if tag else f"{TTL_ROOT}{expires_ms}/{key}"


def expiry_of(key: str) -> float | None:
    """The unix time a key expires at, or ``None`` for keys without a TTL."""
    m = _EXPIRY.match(key) or _MARKER.match(key)
    return int(m[1]) / 1000 if m else None


def expired_keys(keys: list[str], now: float) -> list[str]:
    """The keys among ``keys`` whose TTL has passed at unix time ``now``: expired
    payload objects, and expired markers each followed by the key it marks."""
    out: list[str] = []
    for k in keys:
        e = expiry_of(k)
        if e is None or e > now:
            continue
        out.append(k)
        m = _MARKER.match(k)
        if m:
            out.append(m[2])
    return out


class Reaper:
    """Removes expired objects from the store every ``interval_s``.

    ``sweep()`` does one pass and returns how many objects it removed (at most
    ``budget``: one listing of the master's keys and one batched remove, so a pass
    is bounded however much expired); ``start()`` runs passes on a daemon thread
    until ``close()``. Any process may run one, any number at once (removing an
    absent key is fine). Lists keys through the master's admin API, so it needs
    ``settings.admin_address`` to answer. Expired objects are logged (a warning
    with their count): an expiry is a payload nobody took in time, never silent.
    """

    def __init__(
        self, settings: MooncakeSettings, interval_s: float = 1.0, client: StoreClient | None = None
    ) -> None:
        self._settings = settings
        self._interval = interval_s
        self._own_client = client is None
        # it only lists and removes: no direct reads, so no second Transfer Engine
        self._client = client or StoreClient(
            dataclasses.replace(settings, store_direct_reads=False)
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.removed = 0

    def sweep(self, now: float | None = None, budget: int = SWEEP_BUDGET) -> int:
        text = admin_get(self._settings.admin_address, "/get_all_keys").decode()
        doomed = expired_keys([k for k in text.splitlines() if k], now or time.time())
        if len(doomed) > budget:  # cut between groups: a marker goes with its object
            cut = budget + 1 if doomed[budget - 1].startswith(TTL_ROOT) else budget
            doomed = doomed[:cut]
        self._client.remove_many(doomed)
        if doomed:
            _log.warning("reaper: removed %d expired store objects nobody took", len(doomed))
        self.removed += len(doomed)
        return len(doomed)

    def start(self) -> Reaper:
        self._thread = threading.Thread(target=self._run, name="mcd-reaper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sweep()
            except Exception:  # a missed pass is retried on the next tick
                continue

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._own_client:
            self._client.close()

"""Time-to-live for published payloads, and the reaper that enforces it.

A payload published with ``ttl_s`` carries ``expires_at`` (unix seconds) in
its handle, and in store mode the expiry is written into every object key:

    mcd/<request_id>/<kind>/<nonce>@<expires_ms>/<tensor>.<chunk>

so any process that can list the store's keys can tell what is abandoned by
the key alone, without asking the producer (who may be dead). The store host
of ``LocalCluster`` runs ``Reaper`` for its pool; a deployment runs one next
to its store hosts. Consumers treat an expired handle as gone whether or not
the reaper has come by yet. Clocks are assumed synchronised (NTP) to well
under a TTL.
"""

from __future__ import annotations

import re
import threading
import time

from mooncake_diffusion._mooncake.master import admin_get
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.settings import MooncakeSettings

__all__ = ["Reaper", "expired_keys", "expiry_of"]

_EXPIRY = re.compile(r"^mcd/[^/]+/[^/]+/[^/@]+@(\d+)/")


def expiry_of(key: str) -> float | None:
    """The unix time a key expires at, or ``None`` for keys without a TTL."""
    m = _EXPIRY.match(key)
    return int(m[1]) / 1000 if m else None


def expired_keys(keys: list[str], now: float) -> list[str]:
    """The keys among ``keys`` whose TTL has passed at unix time ``now``."""
    return [k for k in keys if (e := expiry_of(k)) is not None and e <= now]


class Reaper:
    """Removes expired objects from the store every ``interval_s``.

    ``sweep()`` does one pass and returns how many objects it removed; ``start()``
    runs passes on a daemon thread until ``close()``. Lists keys through the
    master's admin API, so it needs ``settings.admin_address`` to answer.
    """

    def __init__(
        self, settings: MooncakeSettings, interval_s: float = 1.0, client: StoreClient | None = None
    ) -> None:
        self._settings = settings
        self._interval = interval_s
        self._own_client = client is None
        self._client = client or StoreClient(settings)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.removed = 0

    def sweep(self, now: float | None = None) -> int:
        text = admin_get(self._settings.admin_address, "/get_all_keys").decode()
        doomed = expired_keys([k for k in text.splitlines() if k], now or time.time())
        self._client.remove_many(doomed)
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

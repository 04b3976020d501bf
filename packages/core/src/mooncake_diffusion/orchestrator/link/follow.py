"""Finding the orchestrator leader through etcd, for workers and clients.

    where = LeaderAddress.parse("etcd://10.0.0.1:2379,10.0.0.2:2379/mcd/orch")
    where.current()        # Announcement(name, term, workers="tcp://...", api="http://...")
    follow = Follower("etcd://...")   # in a StageWorker: keeps its socket on the leader
    follow.sync(sock)      # (re)connects the DEALER socket when the leader moved

A leader (``ha.service``) announces where it serves in the value of
``<prefix>/leader`` once it has recovered the journal and bound its sockets; the
key goes with the leader's lease, so a dead leader's address disappears within
the lease. An address that is not ``etcd://`` is a fixed endpoint (the
single-orchestrator deployment): ``Follower`` then connects once and never moves.

``Follower`` polls etcd every ``poll_s`` on its own thread (a partitioned etcd must
not stall a worker's loop and its heartbeats); ``close()`` stops it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.platform.etcd import EtcdClient, EtcdUnavailableError

__all__ = ["DEFAULT_PREFIX", "ETCD_SCHEME", "Announcement", "Follower", "LeaderAddress"]

ETCD_SCHEME = "etcd://"
#: the key prefix of the orchestrator's election and journal when none is given
DEFAULT_PREFIX = "/mooncake-diffusion/orchestrator"


class Announcement(msgspec.Struct, frozen=True):
    """Where the leader of term ``term`` serves: ``workers`` (ZeroMQ), ``api`` (HTTP)."""

    name: str
    term: int
    workers: str
    api: str


class LeaderAddress:
    """Reads the leader's announcement from etcd (``endpoints``: ``host:port``)."""

    def __init__(self, endpoints: list[str], prefix: str = DEFAULT_PREFIX) -> None:
        self.etcd = EtcdClient(endpoints)
        self.prefix = prefix.rstrip("/")
        self.key = f"{self.prefix}/leader"

    @classmethod
    def parse(cls, url: str) -> LeaderAddress:
        """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (prefix default ``DEFAULT_PREFIX``)."""
        if not url.startswith(ETCD_SCHEME):
            raise ConfigError(f"a leader address is etcd://HOST:PORT[,...][/PREFIX], got {url!r}")
        hosts, sep, prefix = url[len(ETCD_SCHEME) :].partition("/")
        endpoints = [h for h in hosts.split(",") if h]
        if not endpoints:
            raise ConfigError(f"no etcd endpoint in {url!r}")
        return cls(endpoints, "/" + prefix if sep and prefix else DEFAULT_PREFIX)

    def current(self, timeout: float = 1.0) -> Announcement | None:
        """The announced leader, or None (no leader, not announced yet, etcd unreachable)."""
        try:
            raw = self.etcd.get(self.key, timeout=timeout)
        except EtcdUnavailableError:
            return None
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw, type=Announcement)
        except msgspec.DecodeError:
            return None  # the key exists, the address is not announced yet

    def wait(self, timeout: float, *, poll_s: float = 0.1) -> Announcement | None:
        """The announced leader, waiting up to ``timeout`` for one; None after that."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.current(timeout=min(1.0, max(0.1, timeout)))
            if got is not None or time.monotonic() >= deadline:
                return got
            time.sleep(poll_s)


class Follower:
    """Which orchestrator endpoint a worker's socket should be connected to now."""

    def __init__(
        self, orchestrator: str, *, poll_s: float = 0.2, wake: Callable[[], None] | None = None
    ) -> None:
        etcd = orchestrator.startswith(ETCD_SCHEME)
        self._where = LeaderAddress.parse(orchestrator) if etcd else None
        self._address: str | None = None if self._where else orchestrator
        self._connected: str | None = None
        self._poll_s = poll_s
        self._wake = wake
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._where is not None:
            got = self._where.current()
            self._address = got.workers if got else None
            self._thread = threading.Thread(target=self._watch, name="mcd-follow", daemon=True)
            self._thread.start()

    @property
    def address(self) -> str | None:
        """The endpoint to talk to now (None: no leader announced)."""
        return self._address

    def _watch(self) -> None:
        assert self._where is not None
        while not self._stop.wait(self._poll_s):
            got = self._where.current(timeout=max(self._poll_s, 0.5))
            if got is not None and got.workers != self._address:
                self._address = got.workers
                if self._wake is not None:
                    self._wake()

    def sync(self, sock: zmq.Socket) -> bool:
        """Connect ``sock`` to the current address (leaving the previous one). ``True``
        when it moved to another endpoint than the one it was connected to (the
        caller introduces itself there again)."""
        target = self._address
        if target is None or target == self._connected:
            return False
        moved = self._connected is not None
        if moved:
            with contextlib.suppress(zmq.ZMQError):
                sock.disconnect(self._connected)
        sock.connect(target)
        self._connected = target
        return moved

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

"""Mooncake master HA: two or more ``mooncake_master`` on one etcd, one leads.

Each master runs with ``-enable_ha -ha_backend_type=etcd -etcd_endpoints=...``
(and ``-enable_oplog`` unless told otherwise). The leader holds the etcd key
``mooncake-store/<cluster_id>/master_view`` (value: its RPC ``host:port``) under a
5 s lease, warms up 5 s, then opens its RPC port; the others stand by. Clients
(our ``StoreClient``, the store host) are given ``etcd://h1:p1;h2:p2`` as their
master and Mooncake's client follows the leader itself (it re-mounts its
segments on the new one). ``master_view.leader_rpc_address`` reads the key for our probe.

Closing a native client of an HA master takes about 30 s (measured, 0.3.13.post1).

One etcd per process: Mooncake's client library keeps one process-wide etcd
connection, so a second ``setup()`` naming another etcd fails (-1, "Etcd client
already connected"). Clusters that share a process share an etcd and tell
themselves apart by ``cluster_id`` (``MC_STORE_CLUSTER_ID``, read at ``setup()``).

What survives a leader's SIGKILL (measured, ``tests/integration/test_master_ha.py``,
``docs/deployment.md``): with the OpLog every object whose put had completed is
found again on the new leader; without it none is (the new leader starts empty).
Puts and gets fail with RPC errors for the takeover window (lease expiry plus the
5 s warm-up: about 9-10 s on loopback); our store calls retry them within their
deadline, and a stage whose input is gone is rerun as after any lost input.

``HaMasters`` duck-types ``MasterProcess`` for ``LocalCluster``: ``start``,
``stop``, ``proc`` (the leader's), ``restart_killed`` (kills the leader and
starts a replacement standby), plus ``leader()`` and ``kill_leader()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from mooncake_diffusion._mooncake.master import MasterProcess, admin_get
from mooncake_diffusion._mooncake.master_view import DEFAULT_CLUSTER_ID
from mooncake_diffusion.errors import MasterUnavailableError
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["HaMasters"]


class HaMasters:
    """``count`` HA masters on the etcd at ``etcd_endpoints``, on free loopback ports."""

    def __init__(
        self,
        etcd_endpoints: list[str],
        count: int = 2,
        *,
        host: str = "127.0.0.1",
        lease_ttl_ms: int = 1000,
        client_ttl_s: int = 3,
        oplog: bool = True,
        cluster_id: str | None = None,
        log_dir: str | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("at least one master")
        self.etcd = list(etcd_endpoints)
        #: the clients' ``MC_STORE_CLUSTER_ID`` (read at their setup), else Mooncake's default
        cluster_id = cluster_id or os.environ.get("MC_STORE_CLUSTER_ID") or DEFAULT_CLUSTER_ID
        self.cluster_id = cluster_id
        self.oplog = oplog
        flags = (
            "-enable_ha=true",
            "-ha_backend_type=etcd",
            f"-etcd_endpoints={';'.join(self.etcd)}",
            f"-cluster_id={cluster_id}",
            *(("-enable_oplog=true",) if oplog else ()),
        )
        self._spawned = 0
        self._make = lambda: MasterProcess(
            host,
            lease_ttl_ms=lease_ttl_ms,
            client_ttl_s=client_ttl_s,
            log_path=self._log_path(log_dir),
            extra_args=flags,
        )
        self.masters = [self._make() for _ in range(count)]
        self.settings: MooncakeSettings | None = None
        self.lease_ttl_ms = lease_ttl_ms

    def _log_path(self, log_dir: str | None) -> str | None:
        self._spawned += 1
        return os.path.join(log_dir, f"master{self._spawned}.log") if log_dir else None

    @property
    def master_address(self) -> str:
        """What clients pass as their master: ``etcd://...``."""
        return "etcd://" + ";".join(self.etcd)

    def start(self, timeout: float = 30.0) -> MooncakeSettings:
        """Start every master; returns once one of them serves as leader (about 5 s:
        Mooncake's warm-up). The settings name the masters through etcd."""
        for m in self.masters:
            m.spawn_only()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.leader() is not None:
                self.settings = MooncakeSettings(
                    master=self.master_address, store_lease_s=self.lease_ttl_ms / 1000
                )
                return self.settings
            time.sleep(0.05)
        self.stop()
        raise MasterUnavailableError(f"no HA master became leader within {timeout:.0f}s")

    @staticmethod
    def health(m: MasterProcess) -> dict[str, object]:
        """``/health`` of master ``m`` (``{}`` when it does not answer)."""
        if m.proc is None or m.proc.poll() is not None or m.settings is None:
            return {}
        try:
            return json.loads(admin_get(m.settings.admin_address, "/health", 0.5))
        except (OSError, ValueError):
            return {}

    def leader(self) -> MasterProcess | None:
        """The master that says it leads and serves now, if any."""
        for m in self.masters:
            h = self.health(m)
            if h.get("role") == "leader" and h.get("service_ready"):
                return m
        return None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The serving leader's process (``None`` while none serves)."""
        m = self.leader()
        return m.proc if m is not None else None

    @property
    def admin_address(self) -> str:
        """The serving leader's admin address (``MasterUnavailableError`` if none)."""
        m = self.leader()
        if m is None or m.settings is None:
            raise MasterUnavailableError("no HA master serves now")
        return m.settings.admin_address

    def kill_leader(self) -> MasterProcess:
        """SIGKILL the serving leader (fault tests); returns it (stopped)."""
        m = self.leader()
        if m is None or m.proc is None:
            raise MasterUnavailableError("no HA master serves now")
        m.proc.kill()
        m.proc.wait()
        return m

    def wait_leader(self, timeout: float = 30.0) -> MasterProcess:
        """Block until a master serves as leader; ``MasterUnavailableError`` after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.leader()
            if m is not None:
                return m
            time.sleep(0.05)
        raise MasterUnavailableError(f"no HA master took over within {timeout:.0f}s")

    def restart_killed(self, timeout: float = 30.0) -> None:
        """Kill the leader, wait for a standby to take over, and start a fresh
        standby in the dead one's place (what a supervisor does)."""
        dead = self.kill_leader()
        self.wait_leader(timeout)
        dead.stop()
        fresh = self._make()
        fresh.spawn_only()
        self.masters[self.masters.index(dead)] = fresh

    def stop(self) -> None:
        for m in self.masters:
            m.stop()

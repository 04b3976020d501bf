"""An embedded Mooncake cluster: a real master plus a store host, on loopback.

    with LocalCluster(pool_bytes=1 << 30) as cluster:
        conn = DiffusionConnector(role="denoise", settings=cluster.settings)
        ...
        cluster.keys()        # what the store holds right now (leak checks)
        cluster.clear()       # remove every key (a test's leftovers, after reporting them)
        cluster.healthy()     # both processes up and the master ready; else restart()

``LocalCluster(masters=2, etcd_endpoints=etcd.endpoints)`` runs Mooncake master
HA instead of one master (``_mooncake/ha.py``): clients get ``etcd://...`` as
their master and ``cluster.masters.kill_leader()`` is the fault.

Start-up takes about 1.5 s; ``close()`` stops the store host, then the master.
Children run in their own sessions and the store host exits when this process
dies (its stdin closes), so nothing outlives a crashed parent for long.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

from mooncake_diffusion._mooncake.ha import HaMasters
from mooncake_diffusion._mooncake.master import MasterProcess, admin_get
from mooncake_diffusion._mooncake.spill import SPILL_MASTER_FLAGS
from mooncake_diffusion.errors import MasterUnavailableError
from mooncake_diffusion.platform import bindshim
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["LocalCluster"]


class LocalCluster:
    """A context manager owning one ``mooncake_master`` and one store host process."""

    def __init__(
        self,
        pool_bytes: int = 1 << 30,
        *,
        host: str = "127.0.0.1",
        lease_ttl_ms: int = 1000,
        log_dir: str | None = None,
        reap_interval_s: float = 1.0,
        store_port: int | None = None,
        prefault: bool = False,
        masters: int = 1,
        etcd_endpoints: list[str] | None = None,
        oplog: bool = True,
        spill_dir: str | None = None,
    ) -> None:
        self.pool_bytes = pool_bytes
        #: fault the store host's pool in before it says ready (``store_host --prefault``)
        self.prefault = prefault
        #: bytes the store host faulted in at its last start (0 without ``prefault``)
        self.prefaulted_bytes = 0
        #: the store host's segment port, pinned (Mooncake's MC_STORE_CLIENT_MIN/MAX_PORT):
        #: a restarted store host comes back under the same segment name
        self.store_port = store_port
        self.reap_interval_s = reap_interval_s
        self.host = host
        self.log_dir = log_dir
        self._master: MasterProcess | HaMasters
        if etcd_endpoints:  # Mooncake master HA: `masters` masters, one leads
            if spill_dir:
                raise ValueError("spill with HA masters is not wired yet")
            self._master = HaMasters(
                etcd_endpoints, masters, host=host, lease_ttl_ms=lease_ttl_ms, oplog=oplog,
                log_dir=log_dir,
            )  # fmt: skip
            self.reap_interval_s = 0.0  # the reaper lists keys on one admin address
        else:
            if masters != 1:
                raise ValueError("more than one master needs etcd_endpoints (HA)")
            self._master = MasterProcess(
                host,
                lease_ttl_ms=lease_ttl_ms,
                log_path=os.path.join(log_dir, "master.log") if log_dir else None,
                extra_args=SPILL_MASTER_FLAGS if spill_dir else (),
            )
        #: the store host spills a full pool to files here (``_mooncake/spill.py``)
        self.spill_dir = spill_dir
        self._store_host: subprocess.Popen[bytes] | None = None
        self.settings: MooncakeSettings | None = None

    def start(self, timeout: float = 30.0) -> MooncakeSettings:
        """Start master and store host; returns the settings clients connect with."""
        try:
            settings = self._master.start(timeout)
            self._start_store_host(settings, timeout)
        except BaseException:
            self.close()
            raise
        self.settings = settings
        return settings

    def _start_store_host(self, settings: MooncakeSettings, timeout: float) -> None:
        log = (
            open(os.path.join(self.log_dir, "store_host.log"), "ab")  # noqa: SIM115
            if self.log_dir
            else subprocess.DEVNULL
        )
        self._store_host = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.transfer.store_host",
                f"--master={settings.master}",
                *([f"--admin={settings.admin}"] if settings.admin else []),
                f"--host={self.host}",
                f"--pool-bytes={self.pool_bytes}",
                f"--reap-interval={self.reap_interval_s}",
                "--exit-on-stdin-eof",
                *(["--prefault"] if self.prefault else []),
                *([f"--spill-dir={self.spill_dir}"] if self.spill_dir else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env=self._store_env(),
        )
        if log is not subprocess.DEVNULL:
            log.close()
        out = self._store_host.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else b""
        hello = json.loads(line) if line else {}
        if not hello.get("ready"):
            raise MasterUnavailableError(
                f"store host did not come up within {timeout:.0f}s "
                f"(exit code {self._store_host.poll()})"
            )
        self.prefaulted_bytes = hello.get("prefaulted_bytes", 0)

    def _store_env(self) -> dict[str, str]:
        """Ours, with the bind shim for ``host`` (its Transfer Engine's listeners)."""
        env = {**os.environ, **bindshim.env(self.host)}
        if self.store_port is not None:
            port = str(self.store_port)
            env.update(MC_STORE_CLIENT_MIN_PORT=port, MC_STORE_CLIENT_MAX_PORT=port)
        return env

    def keys(self) -> list[str]:
        """Every key the store holds now, from the master's admin API."""
        assert self.settings is not None, "cluster not started"
        text = admin_get(self._admin(), "/get_all_keys").decode()
        return [k for k in text.splitlines() if k]

    def clear(self) -> int:
        """Remove every key in the store, pinned or leased (the master's admin
        ``remove_all``); returns how many. For test isolation, not for serving."""
        assert self.settings is not None, "cluster not started"
        req = urllib.request.Request(f"http://{self._admin()}/api/v1/remove_all", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(json.loads(r.read()).get("removed_count", 0))

    @property
    def masters(self) -> HaMasters | None:
        """The HA masters (``kill_leader``, ``wait_leader``...), ``None`` without HA."""
        return self._master if isinstance(self._master, HaMasters) else None

    def _admin(self) -> str:
        """The admin address of the master that serves now (the leader under HA)."""
        assert self.settings is not None, "cluster not started"
        if isinstance(self._master, HaMasters):
            return self._master.admin_address
        return self.settings.admin_address

    def healthy(self) -> bool:
        """Whether the master and the store host are both running and the master
        reports ready. Never raises."""
        procs = (self._master.proc, self._store_host)
        if self.settings is None or any(p is None or p.poll() is not None for p in procs):
            return False
        try:
            health = json.loads(admin_get(self._admin(), "/health", 2.0))
        except (OSError, ValueError, MasterUnavailableError):
            return False
        return bool(health.get("service_ready"))

    def restart(self, timeout: float = 30.0) -> MooncakeSettings:
        """Stop whatever is left of the cluster and start a fresh one (new ports: read
        ``settings`` again); its previous keys are gone."""
        self.close()
        return self.start(timeout)

    def kill_store_host(self) -> None:
        """SIGKILL the store host (fault tests: every object in the pool dies with it)."""
        if self._store_host is not None:
            self._store_host.kill()
            self._store_host.wait()

    def restart_master(self, timeout: float = 30.0) -> None:
        """SIGKILL the master and start a fresh one on its address, then a fresh store
        host, since the segment died with the master's metadata (fault tests: what
        a supervisor does after a master crash). Every key is gone; ``settings``
        stay valid."""
        assert self.settings is not None, "start() first"
        self._master.restart_killed(timeout)
        self.restart_store_host(timeout)

    def restart_store_host(self, timeout: float = 30.0) -> None:
        """Start a fresh store host (an empty pool) in place of the current one, which
        is SIGKILLed first if still alive (fault tests). ``settings`` stay valid."""
        assert self.settings is not None, "start() first"
        old, self._store_host = self._store_host, None
        if old is not None:
            if old.poll() is None:
                old.kill()
            old.wait()
            for stream in (old.stdin, old.stdout):
                if stream is not None:
                    stream.close()
        self._start_store_host(self.settings, timeout)

    def close(self) -> None:
        """Stop the store host, then the master. Idempotent."""
        proc, self._store_host = self._store_host, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        self._master.stop()
        self.settings = None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_segments(self, count: int = 1, timeout: float = 10.0) -> None:
        """Block until the master lists ``count`` mounted segments."""
        assert self.settings is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = admin_get(self._admin(), "/get_all_segments").decode()
            if len([s for s in text.splitlines() if s.strip()]) >= count:
                return
            time.sleep(0.05)
        raise MasterUnavailableError(f"fewer than {count} store segments after {timeout}s")

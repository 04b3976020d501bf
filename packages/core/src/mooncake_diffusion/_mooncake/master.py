"""Probe a mooncake_master quickly, and run one on free local ports.

Mooncake's own ``setup()`` blocks about 90 s against a dead master, so every
client probes first: a TCP connect to the RPC port and, when the admin address
answers, ``GET /health``. Both are bounded by ``connect_timeout_s``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

from mooncake_diffusion._mooncake import mooncake_dir
from mooncake_diffusion._mooncake.master_view import leader_rpc_address
from mooncake_diffusion.errors import ConfigError, MasterUnavailableError
from mooncake_diffusion.platform.childproc import free_port, free_ports, terminate
from mooncake_diffusion.platform.settings import MooncakeSettings, is_etcd_master, split_address

__all__ = ["MasterProcess", "admin_get", "free_port", "pool_capacity", "probe_master", "terminate"]

# free_port and terminate live in childproc (etcd.py uses them too); re-exported here


def admin_get(admin: str, path: str, timeout: float = 2.0) -> bytes:
    """GET ``http://{admin}{path}`` from the master's admin server."""
    with urllib.request.urlopen(f"http://{admin}{path}", timeout=timeout) as r:
        return r.read()


def pool_capacity(settings: MooncakeSettings) -> int | None:
    """The bytes of every store segment mounted at the master (its
    ``master_total_capacity_bytes``), or ``None`` when its admin server does not say."""
    try:
        text = admin_get(settings.admin_address, "/metrics").decode(errors="replace")
    except (OSError, ValueError):
        return None
    m = re.search(r"^master_total_capacity_bytes\s+([0-9.e+]+)\s*$", text, re.MULTILINE)
    return int(float(m[1])) if m else None


def probe_master(settings: MooncakeSettings, *, require_admin: bool = False) -> None:
    """Return when the master answers; raise ``MasterUnavailableError`` naming the
    address within ``settings.connect_timeout_s`` otherwise.

    The admin ``/health`` check is skipped when nothing listens on the admin
    address, unless ``require_admin``. An HA master (``etcd://...``) is the leader
    that etcd names now, probed on its RPC port only.
    """
    deadline = time.monotonic() + settings.connect_timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            host, port = split_address(_rpc_address(settings.master), "master")
            with socket.create_connection((host, port), timeout=max(min(left, 1.0), 0.05)):
                break
        except OSError as e:
            last = str(e)
        if time.monotonic() + 0.1 >= deadline:
            raise MasterUnavailableError(
                f"no Mooncake master at {settings.master} ({last}) after "
                f"{settings.connect_timeout_s:.1f}s; start one with `mooncake-diffusion cluster up`"
                " or set MOONCAKE_MASTER"
            )
        time.sleep(0.1)
    if is_etcd_master(settings.master):
        return  # the leader's RPC port opens only once it serves (it warms up first)
    try:
        left = max(deadline - time.monotonic(), 0.2)
        health = json.loads(admin_get(settings.admin_address, "/health", timeout=left))
    except (OSError, ValueError, urllib.error.URLError) as e:
        if require_admin:
            raise MasterUnavailableError(
                f"Mooncake master admin at {settings.admin_address} does not answer: {e}"
            ) from None
        return
    if health.get("status") != "ok" or not health.get("service_ready", True):
        raise MasterUnavailableError(f"Mooncake master at {settings.master} is not ready: {health}")


def _rpc_address(master: str) -> str:
    """``master`` itself, or for an HA ``etcd://`` address the leader it names now
    (``OSError`` while there is none)."""
    if not is_etcd_master(master):
        return master
    leader = leader_rpc_address(master)
    if leader is None:
        raise OSError("no Mooncake master holds the leader key in etcd yet")
    return leader


class MasterProcess:
    """A real ``mooncake_master`` child process on free loopback ports.

    ``start()`` returns once ``/health`` reports ready (about 1 s); ``stop()``
    sends SIGTERM and waits, killing after 10 s. Idempotent.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        lease_ttl_ms: int = 1000,
        client_ttl_s: int = 3,
        log_path: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        #: more ``mooncake_master`` flags (HA: ``_mooncake/ha.py``)
        self.extra_args = extra_args
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.settings: MooncakeSettings | None = None

    def start(self, timeout: float = 20.0) -> MooncakeSettings:
        binary = os.path.join(mooncake_dir(), "mooncake_master")
        if not os.access(binary, os.X_OK):
            raise ConfigError(f"mooncake_master not found or not executable at {binary}")
        for _attempt in range(3):  # a port can be taken between probe and bind
            settings = self._spawn(*free_ports(2, self.host))
            if self._wait_ready(settings, timeout):
                self.settings = settings
                return settings
            self.stop()
        raise MasterUnavailableError("mooncake_master did not become ready after 3 attempts")

    def spawn_only(self) -> MooncakeSettings:
        """Start the process on free ports without waiting for it to serve (an HA
        standby never does before it leads); ``settings`` name it."""
        self.settings = self._spawn(*free_ports(2, self.host))
        return self.settings

    def restart_killed(self, timeout: float = 20.0) -> None:
        """SIGKILL the master and start a fresh one on the same ports (fault tests: a
        crashed master that its supervisor restarts). Its metadata is gone: every
        object, and every store host's segment, which must be mounted again.
        ``settings`` stay valid. Raises ``MasterUnavailableError`` if it does not
        come back within ``timeout``."""
        assert self.settings is not None, "start() first"
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        rpc = int(self.settings.master.rpartition(":")[2])
        admin = int(self.settings.admin_address.rpartition(":")[2])
        if not self._wait_ready(self._spawn(rpc, admin), timeout):
            self.stop()
            raise MasterUnavailableError(f"mooncake_master did not come back on {rpc}")

    def _spawn(self, rpc: int, admin: int) -> MooncakeSettings:
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - owned by Popen
        self.proc = subprocess.Popen(
            [
                os.path.join(mooncake_dir(), "mooncake_master"),
                f"-rpc_port={rpc}",
                f"-rpc_address={self.host}",
                f"-metrics_port={admin}",
                f"-metrics_host={self.host}",
                f"-default_kv_lease_ttl={self.lease_ttl_ms}",
                f"-client_ttl={self.client_ttl_s}",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return MooncakeSettings(
            master=f"{self.host}:{rpc}",
            admin=f"{self.host}:{admin}",
            store_lease_s=self.lease_ttl_ms / 1000,
        )

    def _wait_ready(self, settings: MooncakeSettings, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                health = json.loads(admin_get(settings.admin_address, "/health", 0.5))
                if health.get("service_ready"):
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        terminate(proc, 10.0)

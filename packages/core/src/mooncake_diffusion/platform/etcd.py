"""A real etcd (one or three members) on loopback, and the few v3 calls we need.

    with EtcdCluster(members=3) as etcd:
        etcd.endpoints            # ["127.0.0.1:C1", ...], for clients
        etcd.put("k", "v"); etcd.get_prefix("mooncake-store/")
        etcd.kill(etcd.leader())  # SIGKILL the Raft leader (fault tests)

Members are Debian's ``etcd`` (``etcd-server`` 3.4; ``./dev`` installs it), each
with its own data directory and free loopback client and peer ports, in their
own sessions. ``close()`` stops every member and removes the data directories;
``EtcdCluster.live()`` lists the members of every cluster of this process still
running, for leak checks. Calls go to etcd's v3 JSON gateway (``/v3/kv/range``,
``/v3/kv/put``, ``/v3/maintenance/status``) over ``urllib``: keys and values
travel base64-encoded, as the gateway wants.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from typing import ClassVar

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.platform.childproc import free_ports, terminate

__all__ = [
    "EtcdClient",
    "EtcdCluster",
    "EtcdUnavailableError",
    "etcd_binary",
    "member_argv",
    "prefix_end",
]

#: where Debian's etcd-server puts the binary; ``MCD_ETCD`` overrides it
_DEFAULT_BINARY = "/usr/bin/etcd"


class EtcdUnavailableError(ConnectionError):
    """etcd did not start or does not answer within the time given (an ``OSError``,
    as a refused connection is)."""


def etcd_binary() -> str:
    """The etcd server binary (``$MCD_ETCD``, else Debian's ``/usr/bin/etcd``); raises
    ``ConfigError`` saying how to install it when it is not there."""
    path = os.environ.get("MCD_ETCD") or shutil.which("etcd") or _DEFAULT_BINARY
    if not os.access(path, os.X_OK):
        raise ConfigError(
            f"etcd not found at {path}; install Debian's etcd-server "
            "(`./dev sync` does as root; else `sudo apt-get install -y etcd-server`)"
        )
    return path


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def prefix_end(prefix: str) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd's
    ``range_end`` for a prefix read)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


class EtcdClient:
    """etcd's v3 JSON gateway over ``urllib``: each call goes to the first endpoint
    that answers (``host:port``), starting from the last one that did: a member that
    is cut off (its connections time out) costs one timeout, not one per call."""

    def __init__(self, endpoints: list[str]) -> None:
        if not endpoints:
            raise ConfigError("an etcd client needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._good = 0  # index of the endpoint that answered last

    def call(self, path: str, body: dict[str, object], timeout: float = 2.0) -> dict[str, object]:
        """POST ``body`` to ``/v3/{path}``; ``EtcdUnavailableError`` if no endpoint answers."""
        last = "no endpoint"
        n, start = len(self.endpoints), self._good
        for i in range(start, start + n):
            ep = self.endpoints[i % n]
            req = urllib.request.Request(
                f"http://{ep}/v3/{path}",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    out = json.loads(r.read() or b"{}")
                self._good = i % n
                return out
            except (OSError, ValueError, urllib.error.URLError) as e:
                last = f"{ep}: {e}"
        raise EtcdUnavailableError(last)

    def put(self, key: str, value: str, timeout: float = 2.0) -> None:
        self.call("kv/put", {"key": _b64(key), "value": _b64(value)}, timeout)

    def get(self, key: str, timeout: float = 2.0) -> bytes | None:
        """The value of ``key``, ``None`` when absent."""
        kvs = self.call("kv/range", {"key": _b64(key)}, timeout).get("kvs") or []
        assert isinstance(kvs, list)
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: str, timeout: float = 2.0) -> dict[str, bytes]:
        """Every key under ``prefix`` with its value (a linearizable read)."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        kvs = self.call("kv/range", body, timeout).get("kvs") or []
        assert isinstance(kvs, list)
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in kvs
        }


def member_argv(
    name: str, host: str, client_port: int, peer_port: int, data_dir: str, cluster: str, token: str
) -> list[str]:
    """The command line of one member of a new cluster: ``cluster`` is etcd's
    ``--initial-cluster`` (``name=http://host:peer_port,...``), ``token`` tells this
    cluster's members from another's."""
    return [
        etcd_binary(),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls=http://{host}:{client_port}",
        f"--advertise-client-urls=http://{host}:{client_port}",
        f"--listen-peer-urls=http://{host}:{peer_port}",
        f"--initial-advertise-peer-urls=http://{host}:{peer_port}",
        f"--initial-cluster={cluster}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={os.path.basename(token)}",
        "--logger=zap",
        "--log-level=error",
    ]


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    proc: subprocess.Popen[bytes] | None = None


class EtcdCluster:
    """``members`` etcd processes forming one cluster on ``host``'s free ports."""

    _all: ClassVar[weakref.WeakSet[EtcdCluster]] = weakref.WeakSet()

    def __init__(self, members: int = 1, *, host: str = "127.0.0.1", log_dir: str | None = None):
        if members < 1:
            raise ConfigError("an etcd cluster needs at least one member")
        self.host = host
        self.log_dir = log_dir
        self._root = tempfile.mkdtemp(prefix="mcd-etcd-")
        self.members = [
            _Member(f"m{i}", 0, 0, os.path.join(self._root, f"m{i}")) for i in range(members)
        ]
        self._new_ports()
        EtcdCluster._all.add(self)

    def _new_ports(self) -> None:
        ports = free_ports(2 * len(self.members), self.host)
        for i, m in enumerate(self.members):
            m.client_port, m.peer_port = ports[2 * i], ports[2 * i + 1]

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL (running or not)."""
        return [f"{self.host}:{m.client_port}" for m in self.members]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member; returns once a write goes through and every member
        answers. A member that exits while the cluster forms (another process took
        one of its ports after they were found free) makes it start once more, a new
        cluster on fresh ports."""
        try:
            for attempt in (1, 2):
                deadline = time.monotonic() + timeout
                for m in self.members:
                    self._spawn(m)
                try:
                    self.wait_ready(timeout)
                    self._all_answer(max(deadline, time.monotonic() + 10.0))
                    return self
                except EtcdUnavailableError:
                    if attempt == 2 or not self._exited():
                        raise
                self._stop_members()
                for m in self.members:
                    shutil.rmtree(m.data_dir, ignore_errors=True)
                self._new_ports()
        except BaseException:
            self.close()
            raise
        return self

    def _all_answer(self, deadline: float) -> None:
        """Wait until every member answers or has exited. ``EtcdUnavailableError``
        naming them if any exited, or if one does neither by ``deadline``."""
        waiting = list(self.members)
        while waiting:
            for m in list(waiting):
                if m.proc is None or m.proc.poll() is not None:
                    waiting.remove(m)
                    continue
                try:
                    self._status(m)
                    waiting.remove(m)
                except EtcdUnavailableError:
                    pass
            if waiting and time.monotonic() > deadline:
                names = ", ".join(m.name for m in waiting)
                raise EtcdUnavailableError(f"etcd members did not answer in time: {names}")
            if waiting:
                time.sleep(0.05)
        exited = self._exited()
        if exited:
            raise EtcdUnavailableError(f"etcd members exited: {', '.join(exited)}")

    def _exited(self) -> list[str]:
        """Members whose process ended, with its exit status."""
        return [
            f"{m.name} (exit {m.proc.returncode})"
            for m in self.members
            if m.proc is not None and m.proc.poll() is not None
        ]

    def _spawn(self, m: _Member) -> None:
        cluster = ",".join(f"{x.name}=http://{self.host}:{x.peer_port}" for x in self.members)
        log_path = os.path.join(self.log_dir, f"etcd-{m.name}.log") if self.log_dir else os.devnull
        argv = member_argv(
            m.name, self.host, m.client_port, m.peer_port, m.data_dir, cluster, self._root
        )
        with open(log_path, "ab") as log:
            m.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until a write goes through (a leader is elected)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.put("mcd-etcd-ready", "1", timeout=1.0)
                return
            except EtcdUnavailableError as e:
                last = e
            time.sleep(0.05)
        exited = self._exited()
        ended = f"; exited: {', '.join(exited)}" if exited else ""
        raise EtcdUnavailableError(
            f"etcd did not accept a write within {timeout:.0f}s: {last}{ended}"
        )

    def client(self) -> EtcdClient:
        """A gateway client over every member's endpoint."""
        return EtcdClient(self.endpoints)

    def put(self, key: str, value: str, timeout: float = 2.0) -> None:
        self.client().put(key, value, timeout)

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return self.client().get_prefix(prefix)

    def leader(self) -> int:
        """Index of the member that is the Raft leader now."""
        for i, m in enumerate(self.members):
            if m.proc is None or m.proc.poll() is not None:
                continue
            try:
                status = self._status(m)
            except EtcdUnavailableError:
                continue
            header = status.get("header") or {}
            assert isinstance(header, dict)
            if str(status.get("leader")) == str(header.get("member_id")):
                return i
        raise EtcdUnavailableError("no member says it leads")

    def _status(self, m: _Member) -> dict[str, object]:
        """One member's ``/v3/maintenance/status`` (its own view of the leader)."""
        return EtcdClient([f"{self.host}:{m.client_port}"]).call("maintenance/status", {})

    # ---- faults and teardown ---------------------------------------------------------

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (its data directory stays: ``restart`` brings it back)."""
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, index: int) -> None:
        """Start member ``index`` again on its ports and data (after ``kill``)."""
        self.kill(index)
        self._spawn(self.members[index])  # the data dir exists: it rejoins as itself

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.members if m.proc is not None and m.proc.poll() is None]

    @classmethod
    def live(cls) -> list[int]:
        """PIDs of every etcd member started by this process and still running."""
        return [pid for c in list(cls._all) for pid in c.pids()]

    def close(self) -> None:
        """SIGTERM every member (SIGKILL after 5 s) and remove the data. Idempotent."""
        self._stop_members()
        shutil.rmtree(self._root, ignore_errors=True)

    def _stop_members(self) -> None:
        for m in self.members:
            terminate(m.proc, 5.0)  # forgotten only once it is gone
            m.proc = None

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

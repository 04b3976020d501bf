"""The chaos deployment with the orchestrator as a group on etcd (``orchestrator --etcd``).

Hosts: those of ``deploy``, with ``orch`` replaced by ``orch0`` and ``orch1`` (an
orchestrator each: one leads, the other stands by) and ``etcd0``..``etcd2`` (a
three-member etcd, Debian's ``etcd``). ``orchN`` talks to ``etcdN`` first (the
member "under" it, ``UNDER``). Workers and the client follow the leader
(``etcd://`` over all three members).

etcd traffic has a network of its own (``EtcdHosts``: a second bridge, ``eth1`` in
every host), so a fault can take a host off etcd alone (``cut_etcd``: its API and
worker port stay reachable, as when a leader loses its lease behind a partition that
its workers and clients are not behind) or off both (``partition``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from deploy import API, HEARTBEAT_S, TOKEN, WORKERS, WPORT, Deployment
from hosts import Hosts, Spawned, _ip

from mooncake_diffusion.orchestrator.http.client import OrchestratorClient
from mooncake_diffusion.orchestrator.link.follow import Announcement, LeaderAddress
from mooncake_diffusion.platform.etcd import EtcdClient, EtcdUnavailableError, member_argv

HA_HOSTS = ("master", "store", "etcd0", "etcd1", "etcd2", "orch0", "orch1", *WORKERS)
ORCHS = ("orch0", "orch1")
ETCD_HOSTS = ("etcd0", "etcd1", "etcd2")
#: the etcd member each orchestrator talks to first
UNDER = {"orch0": "etcd0", "orch1": "etcd1"}
CLIENT_PORT, PEER_PORT = 2379, 2380
PREFIX = "/mcd/chaos"
#: the orchestrators' lease (etcd 3.4's minimum): failover is asked to take <= 2x this
LEASE_S = 2


class EtcdHosts(Hosts):
    """``Hosts`` with a second bridge for etcd traffic (module docstring)."""

    def __init__(self, names: Any, log_dir: str) -> None:
        super().__init__(names, log_dir)
        pid = os.getpid()
        self.etcd_subnet = f"10.{150 + (pid >> 8) % 50}.{pid % 256}"
        self.etcd_bridge = f"{self.prefix}eb"
        self._eveth = {n: f"{self.prefix}e{i}" for i, n in enumerate(self.names)}
        self._eips = {n: f"{self.etcd_subnet}.{10 + i}" for i, n in enumerate(self.names)}

    def _up(self) -> None:
        super()._up()
        _ip("link", "add", self.etcd_bridge, "type", "bridge")
        _ip("addr", "add", f"{self.etcd_subnet}.1/24", "dev", self.etcd_bridge)
        _ip("link", "set", self.etcd_bridge, "up")
        for n in self.names:
            ns, veth, peer = self._ns[n], self._eveth[n], self._eveth[n] + "p"
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", "eth1")
            _ip("-n", ns, "addr", "add", f"{self._eips[n]}/24", "dev", "eth1")
            _ip("-n", ns, "link", "set", "eth1", "up")
            _ip("link", "set", veth, "master", self.etcd_bridge)
            _ip("link", "set", veth, "up")

    def etcd_ip(self, host: str) -> str:
        return self._eips[host]

    def partition(self, host: str) -> None:
        """Cut ``host`` off both networks."""
        super().partition(host)
        self.cut_etcd(host)

    def heal(self, host: str) -> None:
        super().heal(host)
        self.heal_etcd(host)

    def cut_etcd(self, host: str) -> None:
        """Cut ``host`` off etcd only."""
        _ip("link", "set", self._eveth[host], "down")

    def heal_etcd(self, host: str) -> None:
        _ip("link", "set", self._eveth[host], "up")

    def close(self) -> None:
        super().close()
        for n in self.names:
            _ip("link", "del", self._eveth[n], check=False)
        _ip("link", "del", self.etcd_bridge, check=False)

    def leftovers(self) -> list[str]:
        links = _ip("-o", "link", "show", check=False).stdout
        mine = [*self._eveth.values(), self.etcd_bridge]
        return super().leftovers() + [w for w in mine if f" {w}:" in links or f" {w}@" in links]


class HaDeployment(Deployment):
    """``Deployment`` with the orchestrator group and its etcd (module docstring)."""

    net: EtcdHosts

    def __init__(self, net: EtcdHosts, work: Path, **kw: Any) -> None:
        super().__init__(net, work, **kw)
        self.lease_s = LEASE_S

    # ------------------------------------------------------------------ addresses
    def etcd_endpoints(self, first: str | None = None) -> list[str]:
        """Every member's client address; ``first``'s (its own host's member) first."""
        order = sorted(ETCD_HOSTS, key=lambda h: h != first)
        return [f"{self.net.etcd_ip(h)}:{CLIENT_PORT}" for h in order]

    @property
    def url(self) -> str:
        return f"etcd://{','.join(self.etcd_endpoints())}{PREFIX}"

    @property
    def orchestrator_address(self) -> str:
        return self.url

    def leader(self, timeout: float = 60.0) -> Announcement:
        got = LeaderAddress(self.etcd_endpoints(), PREFIX).wait(timeout)
        assert got is not None, "no orchestrator leader announced"
        return got

    def wait_leader(self, other_than: str | None = None, timeout: float = 60.0) -> Announcement:
        """Poll etcd (every 20 ms) until a leader is announced, one not named
        ``other_than`` when given."""
        where = LeaderAddress(self.etcd_endpoints(), PREFIX)
        deadline = time.monotonic() + timeout
        while True:
            got = where.current(timeout=0.5)
            if got is not None and got.name != other_than:
                return got
            assert time.monotonic() < deadline, f"no new leader within {timeout}s"
            time.sleep(0.02)

    def etcd_leader(self) -> str | None:
        """The host of etcd's Raft leader (None when no live member says)."""
        for h in ETCD_HOSTS:
            try:
                st = EtcdClient([f"{self.net.etcd_ip(h)}:{CLIENT_PORT}"]).call(
                    "maintenance/status", {}, timeout=1.0
                )
            except EtcdUnavailableError:
                continue
            header = st.get("header") or {}
            assert isinstance(header, dict)
            if str(st.get("leader")) == str(header.get("member_id")):
                return h
        return None

    # ------------------------------------------------------------------ processes
    def start_etcd(self, host: str) -> Spawned:
        ip = self.net.etcd_ip(host)
        cluster = ",".join(f"e-{h}=http://{self.net.etcd_ip(h)}:{PEER_PORT}" for h in ETCD_HOSTS)
        argv = member_argv(
            f"e-{host}",
            ip,
            CLIENT_PORT,
            PEER_PORT,
            str(self.work / f"etcd-{host}"),
            cluster,
            str(self.work),
        )
        p = self.net.spawn(host, argv)
        self.procs[f"etcd-{host}"] = p
        return p

    def start_candidate(self, host: str, expect: str = "orchestrator ") -> Spawned:
        ip = self.net.ip(host)
        p = self.net.spawn(
            host,
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.cli",
                "orchestrator",
                "--etcd",
                ",".join(self.etcd_endpoints(UNDER[host])),
                "--etcd-prefix",
                PREFIX,
                "--name",
                host,
                "--lease",
                str(self.lease_s),
                "--host",
                ip,
                "--port",
                str(API),
                "--worker-port",
                str(WPORT),
                "--heartbeat-timeout",
                str(self.heartbeat_timeout),
                "--max-attempts",
                str(self.max_attempts),
            ],
            self.env(host),
        )
        self.procs[host] = p
        p.wait_for(expect, timeout=60)
        return p

    def start_orchestrator(self) -> Spawned:
        for h in ETCD_HOSTS:
            if f"etcd-{h}" not in self.procs:
                self.start_etcd(h)
        deadline = time.monotonic() + 60
        while True:  # a write goes through once the members have elected a leader
            try:
                EtcdClient(self.etcd_endpoints()).put("mcd-chaos-ready", "1")
                break
            except EtcdUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        first = self.start_candidate(ORCHS[0], "orchestrator leading")
        for h in ORCHS[1:]:
            self.start_candidate(h, "orchestrator standby")
        if self.client is None:
            self.client = OrchestratorClient(self.url, token=TOKEN, timeout=120)
        return first

    def kill_host(self, host: str) -> None:
        """SIGKILL every process on ``host`` (an orchestrator, or an etcd member)."""
        for key in (host, f"etcd-{host}"):
            if key in self.procs:
                self.procs[key].kill()

    def revive_host(self, host: str) -> None:
        """Start again what ``kill_host`` killed: an etcd member on its data, an
        orchestrator (it stands by)."""
        if f"etcd-{host}" in self.procs and self.procs[f"etcd-{host}"].popen.poll() is not None:
            self.start_etcd(host)
        if host in ORCHS and self.procs[host].popen.poll() is not None:
            self.start_candidate(host, "orchestrator standby")

    def down(self) -> dict[str, int]:
        rcs = super().down()
        for h in ORCHS:
            if h in self.procs:
                rcs[h] = self.procs[h].stop()
        for h in ETCD_HOSTS:
            if f"etcd-{h}" in self.procs:
                self.procs[f"etcd-{h}"].stop()  # etcd's own exit code: not ours to assert
        return rcs


def wait_line(p: Spawned, text: str, after: int, timeout: float = 60.0) -> None:
    """Block until ``text`` appears in ``p``'s output past offset ``after``."""
    deadline = time.monotonic() + timeout
    while text not in p.output()[after:]:
        assert time.monotonic() < deadline, f"{p.host}: {text!r} not seen:\n{p.output()[-2000:]}"
        time.sleep(0.05)


__all__ = [
    "ETCD_HOSTS",
    "HA_HOSTS",
    "HEARTBEAT_S",
    "LEASE_S",
    "ORCHS",
    "UNDER",
    "EtcdHosts",
    "HaDeployment",
]

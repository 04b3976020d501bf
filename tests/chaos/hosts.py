"""Hosts as Linux network namespaces on one bridge (the chaos tier's machine room).

    with Hosts(["master", "store", "orch", "enc", "den0", "den1", "dec0", "dec1"]) as net:
        p = net.spawn("master", [...])        # a process "on" that host
        net.ip("master")                      # its address on the bridge
        net.partition("den0"); net.heal("den0")   # its link down / up

Each host is a namespace with one veth into a bridge in the root namespace; the
root namespace holds the bridge's address and plays the client host (the test
talks to the orchestrator API and the master's admin port over the bridge). No
traffic takes loopback between hosts. Names are unique per process (a pid
prefix), so several runs on one machine do not collide; ``close()`` removes the
namespaces, veths and bridge even after a failure and kills what it spawned.

``available()`` says whether namespaces can be made here (root and iproute2),
and why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

__all__ = ["Hosts", "Spawned", "available"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """``None`` when namespaces can be made here; otherwise the reason they cannot."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a VM/container with CAP_NET_ADMIN)"
    probe = f"mcdprobe{os.getpid() % 100000}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Spawned:
    """A process on a host; its output is kept (``lines``) and searchable."""

    def __init__(self, host: str, argv: list[str], env: dict[str, str], log: str) -> None:
        self.host = host
        self.argv = argv
        self.log = log
        self._f = open(log, "w")  # noqa: SIM115 - closed in wait()/kill()
        self.popen = subprocess.Popen(
            argv, stdout=self._f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """Block until ``text`` appears in the output; the output then. Raises
        ``AssertionError`` with the output when the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.output()
            if text in out:
                return out
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.host}: {text!r} not seen (rc {self.popen.poll()}):\n{out[-3000:]}"
                )
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, so a stopped process dies too) and reap."""
        if self.popen.poll() is None:
            with _quiet():
                os.kill(self.popen.pid, signal.SIGCONT)
            with _quiet():
                os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(30)
        self._f.close()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait, SIGKILL after ``timeout``; the exit code."""
        if self.popen.poll() is None:
            with _quiet():
                os.kill(self.popen.pid, signal.SIGCONT)
            with _quiet():
                os.kill(self.popen.pid, signal.SIGTERM)
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -9
        self._f.close()
        return rc


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: object, *_: object) -> bool:
        return tp is ProcessLookupError


class Hosts:
    """Namespaced hosts on one bridge; see the module docstring."""

    def __init__(self, names: Sequence[str], log_dir: str) -> None:
        tag = os.getpid() % 100000
        self.prefix = f"mcd{tag}"
        # one /24 per process id, away from common private ranges' low octets
        self.subnet = f"10.{200 + (os.getpid() >> 8) % 50}.{os.getpid() % 256}"
        self.bridge = f"{self.prefix}br"
        self.log_dir = log_dir
        self.names = list(names)
        self._ns = {n: f"{self.prefix}-{n}" for n in self.names}
        self._veth = {n: f"{self.prefix}v{i}" for i, n in enumerate(self.names)}
        self._ips = {n: f"{self.subnet}.{10 + i}" for i, n in enumerate(self.names)}
        self.spawned: list[Spawned] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ topology
    def __enter__(self) -> Hosts:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for n in self.names:
            ns, veth, peer = self._ns[n], self._veth[n], self._veth[n] + "p"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self._ips[n]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")

    def ip(self, host: str) -> str:
        return self._ips[host]

    @property
    def client_ip(self) -> str:
        """The root namespace's address on the bridge (the client host)."""
        return f"{self.subnet}.1"

    def partition(self, host: str) -> None:
        """Cut ``host`` off the bridge (its link down): nothing in or out."""
        _ip("link", "set", self._veth[host], "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self._veth[host], "up")

    # ------------------------------------------------------------------ processes
    def spawn(self, host: str, argv: list[str], env: dict[str, str] | None = None) -> Spawned:
        """Run ``argv`` in ``host``'s namespace (``ip netns exec`` execs it: the pid is
        the program's own, so signals reach it directly)."""
        with self._lock:
            idx = len(self.spawned)
        log = os.path.join(self.log_dir, f"{idx:02d}-{host}.log")
        full = {**os.environ, **(env or {})}
        p = Spawned(host, ["ip", "netns", "exec", self._ns[host], *argv], full, log)
        with self._lock:
            self.spawned.append(p)
        return p

    def close(self) -> None:
        """Kill every spawned process still running, then remove namespaces, veths and
        the bridge. Never raises; idempotent."""
        for p in self.spawned:
            try:
                p.kill()
            except Exception:
                continue
        for n in self.names:
            _ip("netns", "del", self._ns[n], check=False)
            _ip("link", "del", self._veth[n], check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run that still exist (cleanup check)."""
        ns = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return [
            w
            for w in (*self._ns.values(), *self._veth.values(), self.bridge)
            if w in ns.split() or f" {w}:" in links or f" {w}@" in links
        ]

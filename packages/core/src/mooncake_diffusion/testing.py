"""pytest plugin, opt-in: a real Mooncake cluster and leak checks.

Installing mooncake-diffusion registers no plugin. Load it with
``pytest -p mooncake_diffusion.testing`` (or ``addopts`` in your pytest config,
as this repository does, or ``pytest_plugins`` in a top-level ``conftest.py``).

Fixtures:
    mooncake_cluster   session-wide LocalCluster (real master + store host)
    connector_factory  makes DiffusionConnectors on that cluster; at teardown
                       checks each is idle (no in-flight registrations, receive
                       pool empty), closes it, and checks no store key and no
                       extra thread is left
Helpers: ``assert_no_leaks(cluster, thread_baseline)``, ``thread_names()``,
``close_wait_sockets(pid)``, ``tcp_states(pid)``, ``tcp_listeners(pid)``,
``descendants(pid)``, ``non_loopback_listeners(pid)``.

Isolation: one failure reports one failure. Before each test that uses the
cluster, a cluster that died (a crashed master or store host) is restarted
rather than failing every later test. After each such test, keys it left in
the store are reported as that test's error and then removed, so the next test
starts from an empty store; ``assert_no_leaks`` removes the keys it reports too.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion.transfer.connector import DiffusionConnector

__all__ = [
    "assert_no_leaks",
    "close_wait_sockets",
    "descendants",
    "non_loopback_listeners",
    "tcp_listeners",
    "tcp_states",
    "thread_names",
]


def _tcp_sockets(pid: int | str) -> list[tuple[str, str]]:
    """(state, ``local->remote``) of each TCP socket process ``pid`` holds, read in its
    own network namespace (``/proc/PID/net/tcp``); hex, as the kernel lists them."""
    ours = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                ours.add(link[8:-1])
        out = []
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.read().splitlines()[1:]:
                    cols = line.split()
                    if cols[9] in ours:
                        out.append((cols[3], f"{cols[1]}->{cols[2]}"))
        return out
    except OSError:  # the process is gone
        return []


#: TCP state numbers of /proc/net/tcp
_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def close_wait_sockets(pid: int | str = "self") -> list[str]:
    """TCP sockets process ``pid`` holds in CLOSE-WAIT (the peer closed, it did not),
    as ``local->remote``. A process gone: ``[]``."""
    return [addr for state, addr in _tcp_sockets(pid) if _TCP_STATES.get(state) == "CLOSE_WAIT"]


def tcp_states(pid: int | str = "self") -> dict[str, int]:
    """How many TCP sockets process ``pid`` holds in each state (``ESTABLISHED``...)."""
    out: dict[str, int] = {}
    for state, _ in _tcp_sockets(pid):
        name = _TCP_STATES.get(state, state)
        out[name] = out.get(name, 0) + 1
    return out


def _address(hexaddr: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``/proc/net/tcp{,6}``'s ``ADDR:PORT`` (the address in 32-bit host-order words)."""
    h, port = hexaddr.split(":")
    raw = b"".join(bytes.fromhex(h[i : i + 8])[::-1] for i in range(0, len(h), 8))
    return ipaddress.ip_address(raw), int(port, 16)


def tcp_listeners(pid: int | str = "self") -> list[str]:
    """The TCP listening sockets of process ``pid`` as ``address:port`` (IPv6 in
    brackets); a process gone: ``[]``."""
    out = []
    for state, addr in _tcp_sockets(pid):
        if _TCP_STATES.get(state) == "LISTEN":
            ip, port = _address(addr.split("->")[0])
            mapped = getattr(ip, "ipv4_mapped", None)
            shown = f"[::ffff:{mapped}]" if mapped else f"[{ip}]" if ip.version == 6 else ip
            out.append(f"{shown}:{port}")
    return out


def _loopback(listener: str) -> bool:
    ip = ipaddress.ip_address(listener.rpartition(":")[0].strip("[]"))
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 takes IPv4 loopback only
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (from ``/proc/*/stat``)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone
            continue
        parent[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    found, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


def non_loopback_listeners(pid: int) -> list[str]:
    """TCP listeners of ``pid`` and its descendants on a non-loopback address, each
    as ``address:port pid=N``."""
    return [
        f"{addr} pid={p}"
        for p in sorted(descendants(pid))
        for addr in tcp_listeners(p)
        if not _loopback(addr)
    ]


def thread_names() -> set[str]:
    """The live threads of this process, as names that ``assert_no_leaks`` compares."""
    return {f"{t.name}#{t.ident}" for t in threading.enumerate()}


_threads = thread_names


def assert_no_leaks(
    cluster: LocalCluster | None, thread_baseline: set[str], timeout: float = 5.0
) -> None:
    """Fail unless the store holds no key and no thread outlives ``thread_baseline``."""
    deadline = time.monotonic() + timeout
    while True:
        extra = _threads() - thread_baseline
        keys = cluster.keys() if cluster is not None else []
        if not extra and not keys:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if keys:
        assert cluster is not None
        cluster.clear()  # reported below; the next test starts from an empty store
    assert not keys, f"store keys left behind (now removed): {keys[:10]}"
    assert not extra, f"threads left behind: {sorted(extra)}"


@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[LocalCluster]:
    """A real mooncake_master plus a 1 GiB store host for the whole session."""
    with LocalCluster(pool_bytes=1 << 30) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _mooncake_isolation(request: pytest.FixtureRequest) -> Iterator[None]:
    """For tests that use ``mooncake_cluster``: restart it first if it died; after
    the test (and every other fixture's teardown), report and remove leftover keys."""
    if "mooncake_cluster" not in request.fixturenames:
        yield
        return
    cluster: LocalCluster = request.getfixturevalue("mooncake_cluster")
    if not cluster.healthy():
        cluster.restart()
    yield
    if not cluster.healthy():
        return  # the next test that needs it restarts it
    left = cluster.keys()
    if left:
        cluster.clear()
        pytest.fail(f"store keys left behind by this test (now removed): {left[:10]}")


@pytest.fixture
def connector_factory(
    mooncake_cluster: LocalCluster,
) -> Iterator[Callable[..., DiffusionConnector]]:
    baseline = _threads()
    made: list[DiffusionConnector] = []

    def make(mode: str = "p2p", role: str = "denoise", **kw: Any) -> DiffusionConnector:
        conn = DiffusionConnector(role, mode, mooncake_cluster.settings, **kw)  # type: ignore[arg-type]
        made.append(conn)
        return conn

    yield make
    idle = [c.stats() for c in made if not c.closed]
    for c in made:
        c.close()
    for s in idle:
        assert s.temporary_registrations == 0, f"registrations left in flight: {s}"
        assert s.pool_bytes_in_use == 0, f"received payloads not released: {s}"
    assert_no_leaks(mooncake_cluster, baseline)

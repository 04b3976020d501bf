"""Address-level pushes, for engines that keep their own control plane.

Some engines (SGLang's diffusion runtime) already decide who sends what where:
a receiver registers one landing buffer and advertises an opaque session
string, and the sender later writes ``(src, dst, length)`` ranges into it.
``DirectEngine`` is core's implementation of that contract, so an adapter only
translates calls. Calls, in the order they happen:

    engine = DirectEngine(settings, retry=RetryPolicy())     # one per process role
    engine.register(ptr, nbytes)       # both ends: the buffer bytes leave or land in
    engine.session                     # receiver -> the engine's control plane -> sender
    engine.write(session, src, dst, lengths)   # sender; blocks until every byte landed
    engine.unregister(ptr)             # when the buffer goes away
    engine.stats()                     # metrics, any time
    engine.close()                     # idempotent; nothing stays registered

How bytes move (``write`` picks per call and returns the path it took):

- ``"shm"``: both ends share a kernel and PID namespace and the destination
  lies in a receive pool made by ``allocate_pool`` (a memfd): the sender maps
  the pool once and copies with memcpy, at memory speed; a receiver that died
  meanwhile is reported (``PeerGoneError``) after the copy.
- ``"vm"``: same host, the destination lies in other registered memory of the
  receiver: ``process_vm_writev`` (one copy, pinned page by page).
  On either same-host path a receiver that is stopped (``SIGSTOP``) is waited
  for until the policy's ``timeout_s``, then ``DeadlineExceededError``, as the
  network path ends for a peer that stops reading.
- ``"net"``: Transfer Engine writes (RDMA or TCP), submitted asynchronously
  and polled, retried with backoff under ``RetryPolicy``; the policy's
  ``timeout_s`` bounds the whole write, each attempt included, so a peer that
  stops reading ends it with ``DeadlineExceededError``.

The session string is ``"host:port"`` (the Transfer Engine segment, exactly what
a plain Mooncake engine advertises) followed by ``|mcd1|<host identity>|<pid>|
<regions>``, the receiver's registered extents at the time it is read. A
sender therefore also accepts a plain ``"host:port"`` (network only, validated
by the receiving engine). When the session lists regions, a destination outside
all of them is refused with ``UnregisteredDestinationError`` before any byte
moves; the same-host paths write only into listed regions.

Errors: ``UnregisteredDestinationError`` (not retryable), ``PeerGoneError``
(nothing listens at the peer's address, or its process is gone),
``TransferError`` (the peer answered but the write failed), ``ConfigError``
(a malformed session string), ``DeadlineExceededError`` (the write, or its
retries, ran past the deadline; Mooncake cannot cancel a transfer in flight,
so the source range must stay registered and unchanged, and the destination
is lost). ``may_write_late(error)`` says whether bytes of the failed write may
still land in the destination (a network write that failed or ran past its
deadline): the receiver must then not hand that memory to another write.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake_diffusion._mooncake.engine import Engine
from mooncake_diffusion.errors import (
    ConfigError,
    DeadlineExceededError,
    PayloadError,
    PeerGoneError,
    TransferError,
)
from mooncake_diffusion.memory.samehost import (
    PeerPools,
    SharedPool,
    host_identity,
    process_gone,
    process_stopped,
    vm_write,
)
from mooncake_diffusion.memory.tensors import Region
from mooncake_diffusion.platform.settings import MooncakeSettings, split_address

__all__ = [
    "DirectEngine",
    "DirectStats",
    "PeerSession",
    "RetryPolicy",
    "UnregisteredDestinationError",
    "allocate_pool",
    "may_write_late",
    "release_pool",
]

_TAG = "mcd1"
_LATE = "mcd_may_write_late"  # set on an error whose write may still land


def may_write_late(error: BaseException) -> bool:
    """Whether bytes of the ``DirectEngine.write`` that raised ``error`` may still
    land in its destination, so that the receiver must not hand that memory to
    another write: a network write that was submitted and then failed or ran past
    its deadline. Mooncake cannot cancel a submitted transfer, and a failure it
    reports does not prove that nothing lands later (a 64 MiB TCP write to a
    SIGSTOPped receiver was seen to end in -1 within the deadline), so a write the
    peer refused counts too. False for the same-host paths (they copy in the
    calling thread), a destination outside the peer's listed regions
    (``UnregisteredDestinationError``, refused before any byte moved), a malformed
    session, and ``PeerGoneError`` (one refused connect after the attempts: its
    receiver is taken for gone, and an engine that routes around a gone receiver,
    as the SGLang adapter's does, needs none of its memory back either)."""
    return getattr(error, _LATE, False) is True


_PATHS = ("shm", "vm", "net")


class UnregisteredDestinationError(PayloadError):
    """A destination range lies outside every buffer the receiver registered."""


@dataclass(frozen=True)
class RetryPolicy:
    """How network writes are retried: up to ``attempts`` tries in all, waiting
    ``backoff_s`` (doubling, at most ``max_backoff_s``) between them, and never
    past ``timeout_s`` after the write began: each attempt is itself bounded
    by what is left of ``timeout_s``."""

    attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError("retry attempts must be at least 1")
        if self.timeout_s <= 0 or self.backoff_s < 0:
            raise ConfigError("retry timeout must be positive and backoff non-negative")


@dataclass(frozen=True)
class _PeerRegion:
    base: int
    nbytes: int
    fd: int = -1  # a memfd pool: its fd number in the receiver, and token
    token: str = ""

    def holds(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self.nbytes


@dataclass(frozen=True)
class PeerSession:
    """A parsed session string (see the module docstring)."""

    segment: str
    host: str = ""
    pid: int = 0
    regions: tuple[_PeerRegion, ...] = ()

    @classmethod
    def parse(cls, session: str) -> PeerSession:
        """Raises ``ConfigError`` naming the string when it is malformed."""
        parts = session.split("|")
        try:
            split_address(parts[0], "peer session")
            if len(parts) == 1:
                return cls(parts[0])
            if len(parts) != 5 or parts[1] != _TAG:
                raise ValueError("unknown session format")
            regions = []
            for item in filter(None, parts[4].split(";")):
                extent, _, pool = item.partition("@")
                base, _, size = extent.partition("+")
                fd, _, token = pool.partition(".")
                regions.append(
                    _PeerRegion(int(base, 16), int(size, 16), int(fd) if pool else -1, token)
                )
            return cls(parts[0], parts[2], int(parts[3]), tuple(regions))
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"malformed peer session {session!r}: {e}") from None

    def region_of(self, ptr: int, nbytes: int) -> _PeerRegion | None:
        return next((r for r in self.regions if r.holds(ptr, nbytes)), None)


@dataclass
class DirectStats:
    """Counters of one engine since it started (``DirectEngine.stats`` copies them)."""

    writes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    by_path: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PATHS, 0))
    bytes_by_path: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PATHS, 0))
    retries: int = 0
    failures: int = 0
    registered: int = 0

    def copy(self) -> DirectStats:
        return DirectStats(
            self.writes,
            self.bytes,
            self.seconds,
            dict(self.by_path),
            dict(self.bytes_by_path),
            self.retries,
            self.failures,
            self.registered,
        )


# receive pools of this process made by ``allocate_pool``, by base address
_pools: dict[int, SharedPool] = {}
_pools_lock = threading.Lock()


def allocate_pool(nbytes: int) -> SharedPool:
    """A receive buffer in a memfd that same-host senders can map (``"shm"`` path).

    The caller owns it and ends it with ``release_pool(pool.base)``; until then
    ``register`` of any range inside it announces it in the session string.
    """
    pool = SharedPool(nbytes)
    with _pools_lock:
        _pools[pool.base] = pool
    return pool


def release_pool(base: int) -> None:
    """Forget the pool at ``base`` and close its fd (its memory lives while views do)."""
    with _pools_lock:
        pool = _pools.pop(base, None)
    if pool is not None:
        pool.close()


def _pool_holding(ptr: int, nbytes: int) -> SharedPool | None:
    with _pools_lock:
        for pool in _pools.values():
            if pool.base <= ptr and ptr + nbytes <= pool.base + pool.nbytes and pool.fd >= 0:
                return pool
    return None


def _listening(segment: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at the segment's handshake port."""
    host, port = split_address(segment, "peer session")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class DirectEngine:
    """Registered buffers and address-level writes into peers (module docstring).

    Thread-safe: ``write`` may run on several threads at once. ``device`` names
    where registered memory lives for the Transfer Engine (``"cpu"`` or e.g.
    ``"cuda:0"``); the same-host paths apply to host memory only.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        retry: RetryPolicy | None = None,
        device: str = "cpu",
    ) -> None:
        self._engine = Engine(settings)
        self.settings = settings
        self.retry = retry or RetryPolicy()
        self.device = device
        self._regions: dict[int, Region] = {}
        self._sessions: dict[str, PeerSession] = {}
        self._peer_pools = PeerPools()
        self._shm_ok = settings.same_host and device == "cpu"
        self._stats = DirectStats()
        self._lock = threading.Lock()
        self._closed = False

    # -- registration ---------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``[ptr, ptr+nbytes)`` once (a source or a landing buffer);
        raises ``TransferError`` if it partly overlaps a registered range."""
        region = Region(ptr, nbytes, None, self.device)
        self._engine.regs.pin(region)
        with self._lock:
            self._regions[ptr] = region
            self._stats.registered = len(self._regions)

    def unregister(self, ptr: int) -> None:
        """Drop the registration made at ``ptr``; unknown pointers are ignored."""
        with self._lock:
            region = self._regions.pop(ptr, None)
            self._stats.registered = len(self._regions)
        if region is not None:
            self._engine.regs.unpin(region)

    @property
    def segment(self) -> str:
        """The Transfer Engine segment, ``host:port``."""
        return self._engine.segment

    @property
    def session(self) -> str:
        """What a sender needs to write here; read it after registering the
        landing buffer (ranges registered later are reached over the network)."""
        with self._lock:
            regions = sorted(self._regions.values(), key=lambda r: r.ptr)
        items = []
        for r in regions:
            item = f"{r.ptr:x}+{r.nbytes:x}"
            pool = _pool_holding(r.ptr, r.nbytes) if self.device == "cpu" else None
            if pool is not None:
                item += f"@{pool.fd}.{pool.token}"
            items.append(item)
        host = host_identity() if self._shm_ok else ""
        return "|".join((self.segment, _TAG, host, str(os.getpid()), ";".join(items)))

    # -- writes ---------------------------------------------------------------
    def peer(self, session: str) -> PeerSession:
        """The parsed ``session`` (cached); raises ``ConfigError`` when malformed."""
        hit = self._sessions.get(session)
        if hit is None:
            hit = self._sessions[session] = PeerSession.parse(session)
        return hit

    def write(
        self,
        session: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        timeout_s: float | None = None,
    ) -> str:
        """Write local ``src[i]`` into the peer's ``dst[i]`` for ``lengths[i]`` bytes.

        Blocks until every byte landed; returns the path (``"shm"``, ``"vm"``,
        ``"net"``). Raises the errors of the module docstring; after an error
        the destination bytes are unspecified. ``timeout_s`` overrides the
        retry policy's deadline.
        """
        if not len(src) == len(dst) == len(lengths):
            raise PayloadError("src, dst and lengths must have the same length")
        if any(n < 0 for n in lengths):
            raise PayloadError("lengths must be non-negative")
        try:
            peer = self.peer(session)
        except ConfigError:
            self._count_failure()
            raise
        parts = [(s, d, n) for s, d, n in zip(src, dst, lengths, strict=True) if n]
        if peer.regions:
            for _, d, n in parts:
                if peer.region_of(d, n) is None:
                    self._count_failure()
                    raise UnregisteredDestinationError(
                        f"destination [{d:#x}, +{n}) is outside the memory peer "
                        f"{peer.segment} registered: "
                        + ", ".join(f"[{r.base:#x}, +{r.nbytes})" for r in peer.regions)
                    )
        t0 = time.perf_counter()
        path = "net"
        if parts and self._shm_ok and peer.pid and peer.host and peer.host == host_identity():
            path = self._write_local(peer, parts)
        if path != "net":
            self._wait_running(peer, timeout_s)
        if path == "net" and parts:
            try:
                self._write_net(peer, parts, timeout_s)
            except PeerGoneError:
                raise
            except (DeadlineExceededError, TransferError) as e:  # submitted, then failed or
                setattr(e, _LATE, True)  # cut off: a failure Mooncake reports is no fence
                raise
        nbytes = sum(p[2] for p in parts)
        with self._lock:
            s = self._stats
            s.writes += 1
            s.bytes += nbytes
            s.seconds += time.perf_counter() - t0
            s.by_path[path] += 1
            s.bytes_by_path[path] += nbytes
        return path

    def _write_local(self, peer: PeerSession, parts: list[tuple[int, int, int]]) -> str:
        """Same host: memcpy into a mapped pool, ``process_vm_writev`` elsewhere;
        ``"net"`` when the kernel refuses (then the network is used from now on)."""
        pooled: list[tuple[int, int, int, _PeerRegion]] = []
        rest: list[tuple[int, int, int]] = []
        for s, d, n in parts:
            region = peer.region_of(d, n)
            if region is None:  # the session lists no regions: let the network validate
                return "net"
            if region.fd >= 0:
                pooled.append((s, d, n, region))
            else:
                rest.append((s, d, n))
        try:
            for s, d, n, region in pooled:
                base = self._peer_pools.map(peer.pid, region.fd, region.token, region.nbytes)
                ctypes.memmove(base + d - region.base, s, n)
            if rest:
                vm_write(peer.pid, rest)
        except OSError as e:
            if e.errno in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                self._shm_ok = False
                return "net"
            self._count_failure()
            if e.errno in (errno.ESRCH, errno.ENOENT):
                raise PeerGoneError(f"peer process {peer.pid} ({peer.segment}) is gone") from e
            raise TransferError(f"same-host write to {peer.segment}: {e}") from e
        if pooled and process_gone(peer.pid):  # its pool, mapped here, outlives it
            self._count_failure()
            raise PeerGoneError(f"peer process {peer.pid} ({peer.segment}) is gone")
        return "shm" if pooled and not rest else "vm"

    def _wait_running(self, peer: PeerSession, timeout_s: float | None) -> None:
        """After a same-host copy: a receiver that is stopped (``SIGSTOP``) reads nothing,
        though the copy into its memory succeeded. Wait for it to run again within the
        write's deadline, as a network write waits for a peer that stopped reading, and
        raise ``DeadlineExceededError`` when it does not."""
        if not process_stopped(peer.pid):
            return
        wait = timeout_s if timeout_s is not None else self.retry.timeout_s
        deadline = time.monotonic() + wait
        delay = 0.005
        while process_stopped(peer.pid):
            left = deadline - time.monotonic()
            if left <= 0:
                self._count_failure()
                raise DeadlineExceededError(
                    f"peer process {peer.pid} ({peer.segment}) is stopped and did not run "
                    f"again within {wait}s: the bytes were copied, nobody reads them"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.1)

    def _write_net(
        self, peer: PeerSession, parts: list[tuple[int, int, int]], timeout_s: float | None
    ) -> None:
        policy = self.retry
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else policy.timeout_s)
        src, dst, lengths = (list(x) for x in zip(*parts, strict=True))
        backoff = policy.backoff_s
        for attempt in range(1, policy.attempts + 1):
            try:
                self._engine.write(peer.segment, src, dst, lengths, deadline=deadline)
                return
            except DeadlineExceededError:
                self._count_failure()
                raise
            except TransferError as e:
                last = e
            if attempt == policy.attempts:
                break
            if time.monotonic() + backoff > deadline:
                self._count_failure()
                raise DeadlineExceededError(
                    f"write of {sum(lengths)} bytes to {peer.segment} failed {attempt} "
                    f"time(s) and the deadline passed: {last}"
                )
            with self._lock:
                self._stats.retries += 1
            time.sleep(backoff)
            backoff = min(backoff * 2, policy.max_backoff_s)
        self._count_failure()
        if not _listening(peer.segment):
            raise PeerGoneError(
                f"peer {peer.segment} is unreachable: nothing accepts connections there "
                f"({policy.attempts} attempt(s))"
            )
        raise TransferError(
            f"peer {peer.segment} is reachable but refused a write of {sum(lengths)} bytes "
            f"({policy.attempts} attempt(s)); is the destination registered there? ({last})"
        )

    def _count_failure(self) -> None:
        with self._lock:
            self._stats.failures += 1

    # -- the rest ---------------------------------------------------------------
    def stats(self) -> DirectStats:
        """A copy of the counters."""
        with self._lock:
            return self._stats.copy()

    def close(self) -> None:
        """Unregister everything, unmap peers' pools, stop the engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._regions.clear()
        self._peer_pools.close()
        self._engine.close()

"""Peer to peer: the producer pushes each chunk straight into the consumer.

Publishing registers the producer's tensors (once per allocation) and records
them; committing a chunk only marks it ready. ``fetch`` sends the consumer's
registered destinations over the side channel; the producer claims the
payload, then for each chunk in order waits until it is ready, writes it and
sends ``ChunkDone(i)``, and ends with a ``FetchReply``. The consumer blocks in
``recv`` between frames, so per-chunk completion costs no polling.

Bytes move with Transfer Engine writes (``Engine.write``: submitted and polled,
synchronous only when small), or, when both
processes share a kernel and PID namespace, with one local copy (``samehost``):
a memcpy into the consumer's shared receive pool, mapped once, or
``process_vm_writev`` into other destinations; the network is the fallback
whenever the kernel refuses.
A delete-on-consume payload is claimed by exactly one fetch, even across
processes; a failed transfer un-claims it so the consumer may retry.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from mooncake_diffusion._mooncake.engine import Engine
from mooncake_diffusion.errors import (
    AlreadyConsumedError,
    DeadlineExceededError,
    DestinationMismatchError,
    MooncakeDiffusionError,
    PayloadGoneError,
    TransferError,
)
from mooncake_diffusion.memory.device import nic_reaches_gpu
from mooncake_diffusion.memory.samehost import PeerPools, SharedPool, host_identity, vm_write
from mooncake_diffusion.memory.tensors import Region
from mooncake_diffusion.platform.deployment import cuda_build
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.sidechannel import SideChannelClient, SideChannelServer
from mooncake_diffusion.transfer.staging import Staged, Stager
from mooncake_diffusion.transfer.transports.base import Plan, Transport
from mooncake_diffusion.wire.schema import (
    ChunkDone,
    FetchReply,
    FetchRequest,
    LeaseMode,
    P2PSource,
    PayloadHandle,
)

__all__ = ["P2PTransport", "late_write_bound"]

_TOMBSTONES = 65536  # consumed payload ids remembered, to tell "consumed" from "gone"
_READY_POLL_S = 0.25  # how often a server thread waiting on a chunk checks for shutdown
#: Linux's TCP retransmission timeout: 200 ms at first, doubling up to 120 s
_RTO_MIN_S, _RTO_MAX_S = 0.2, 120.0
_TCP_RETRIES2 = "/proc/sys/net/ipv4/tcp_retries2"
_DEFAULT_RETRIES2 = 15  # Linux's
#: set on an error that broke a fetch off before the producer's final reply
_LATE = "mcd_may_write_late"
#: what a write still has to move once its connection works again
_LANDING_S = 60.0


def late_write_bound(retries2: int | None = None) -> float:
    """Seconds after a consumer gave up a p2p producer during which the producer's
    Transfer Engine write may still land in the consumer's memory.

    Measured across network namespaces (``tests/chaos/test_late_write.py``):
    Mooncake's TCP transport neither cancels nor times out a write cut off by a
    partition; when the link comes back it sends the rest, into memory the
    consumer gave up and even unregistered. It stops only when the producer's
    kernel gives the connection up: after ``tcp_retries2`` retransmissions,
    timed as if the timeout started at 200 ms and doubled up to 120 s (924.6 s
    for Linux's default of 15), checked when a retransmission timer fires (up to
    120 s later). The bound is that, one more timer, and ``_LANDING_S`` for the
    rest of the write, counted from the last moment the producer may start a
    write (the fetch's deadline: ``FetchRequest.budget_s``). The producer's
    setting is not visible from here (it is per network namespace): with
    ``retries2`` None this host's is read, and Linux's default 15 is used where
    that is lower or unreadable, so a consumer that lowered its own does not
    shorten the hold for producers that kept the default."""
    if retries2 is None:
        try:
            with open(_TCP_RETRIES2) as f:
                retries2 = max(int(f.read()), _DEFAULT_RETRIES2)
        except (OSError, ValueError):
            retries2 = _DEFAULT_RETRIES2
    model = sum(min(_RTO_MIN_S * 2**i, _RTO_MAX_S) for i in range(max(retries2, 0) + 1))
    return model + _RTO_MAX_S + _LANDING_S


@dataclass
class _Held:
    regions: list[Region]
    leases: list[int]
    lease: LeaseMode
    plan: Plan
    ready: list[threading.Event] = field(default_factory=list)
    claimed: bool = False
    staged: Staged | None = None  # device tensors: what regions stand for
    #: serves whose engine reads ``regions`` now (``_move``) and commits staging into
    #: them (``_in_use``); a payload withdrawn meanwhile (``dropped``) keeps its
    #: registrations and staging buffer until the last of them ends, and no chunk
    #: moved across the withdrawal is reported landed
    moving: int = 0
    dropped: bool = False


class P2PTransport(Transport):
    name = "p2p"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self._engine = Engine(settings)
        self._server: SideChannelServer | None = None
        self._client = SideChannelClient(settings.peer_timeout_s)
        self._held: dict[str, _Held] = {}
        self._consumed: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._shm_ok = settings.same_host  # turned off for good once the kernel refuses
        self._peer_pools = PeerPools()  # consumers' shared receive pools, mapped here
        self._own_pool: SharedPool | None = None  # this consumer's, announced in fetches
        #: inbound staging buffers of fetches broken off, and when no late write of
        #: theirs can land any more (``late_write_s`` after the failure or deadline):
        #: freed then (at the next fetch) or at ``close()``
        self._late_staging: list[tuple[float, Staged]] = []
        self.late_write_s = late_write_bound()
        self._stager = Stager(
            cuda_build, lambda: nic_reaches_gpu(settings.protocol), settings.gpu_path
        )

    # producer side -----------------------------------------------------------
    def prepare(
        self, payload_id: str, regions: Sequence[Region], lease: LeaseMode, plan: Plan
    ) -> P2PSource:
        with self._lock:
            if self._server is None:
                self._server = SideChannelServer(self.settings.local_hostname, self._serve)
        staged = self._stager.outbound(regions)
        if staged is not None:
            regions = staged.regions
        leases: list[int] = []
        try:
            for r in regions:
                leases.append(self._engine.regs.acquire(r))
        except BaseException:
            for lease_id in leases:
                self._engine.regs.release(lease_id)
            raise
        ready = [threading.Event() for _ in plan]
        with self._lock:
            self._held[payload_id] = _Held(list(regions), leases, lease, plan, ready, staged=staged)
        return P2PSource(self._engine.segment, self._server.endpoint)

    def commit(
        self,
        payload_id: str,
        source: object,
        regions: Sequence[Region],
        lease: LeaseMode,
        plan: Plan,
        chunk: int,
    ) -> None:
        """Mark ``chunk`` ready: its bytes wait in the producer's registered memory
        (device tensors: once their producing stream got there, or staged to host)."""
        with self._lock:
            held = self._held.get(payload_id)
        if held is None:
            return
        with self._in_use(held) as usable:  # a withdrawal meanwhile: the buffer stays
            if usable:
                if held.staged is not None:
                    held.staged.send(plan[chunk])
                held.ready[chunk].set()

    def discard(self, handle: PayloadHandle) -> None:
        self._drop(handle.payload_id)

    def holds(self, payload_id: str) -> bool:
        """Whether this producer still holds ``payload_id`` for a consumer."""
        with self._lock:
            return payload_id in self._held

    def _drop(self, payload_id: str) -> None:
        """Withdraw ``payload_id``; its memory is let go now, or by the move or commit
        still using it when that ends (``_in_use``). Never waits."""
        with self._lock:
            held = self._held.pop(payload_id, None)
            if held is None:
                return
            held.dropped = True
            if held.moving:
                return
        self._let_go(held)

    def _let_go(self, held: _Held) -> None:
        """Release ``held``'s leases, then its staging buffer: every one even if a
        release raises (the first error is raised after)."""
        first: BaseException | None = None
        for lease_id in held.leases:
            try:
                self._engine.regs.release(lease_id)
            except BaseException as e:
                first = first or e
        if held.staged is not None:
            held.staged.release()
        if first is not None:
            raise first

    def _claim(self, req: FetchRequest) -> _Held | FetchReply:
        with self._lock:
            held = self._held.get(req.payload_id)
            if held is None:
                if req.payload_id in self._consumed:
                    return FetchReply("consumed", f"payload {req.payload_id} was already consumed")
                return FetchReply("gone", f"payload {req.payload_id} is not held by this producer")
            if held.claimed:
                return FetchReply("consumed", f"payload {req.payload_id} was already consumed")
            want = tuple(r.nbytes for r in held.regions)
            if want != req.lengths or len(req.addrs) != len(want):
                return FetchReply("mismatch", f"consumer offers {req.lengths}, payload has {want}")
            if held.lease == "delete_on_consume":
                held.claimed = True
            return held

    def _serve(self, req: FetchRequest, progress: Callable[[ChunkDone], None]) -> FetchReply:
        # the consumer's deadline on this host's clock: no write starts after it (the
        # consumer holds its memory back from then on, not for ever)
        ends = time.monotonic() + req.budget_s if req.budget_s > 0 else math.inf
        held = self._claim(req)
        if isinstance(held, FetchReply):
            return held
        try:
            for i, segments in enumerate(held.plan):
                if not self._await_ready(req.payload_id, held, i):
                    return FetchReply("gone", f"payload {req.payload_id} was withdrawn")
                if time.monotonic() >= ends:
                    raise DeadlineExceededError(
                        f"chunk {i} of {req.payload_id} was ready after the consumer's deadline"
                    )
                path = self._moving(req, held, segments)
                if path is None:
                    return FetchReply("gone", f"payload {req.payload_id} was withdrawn")
                if held.staged is not None and held.staged.path:
                    path = f"{path}|src={held.staged.path}"
                progress(ChunkDone(i, path))
        except MooncakeDiffusionError as e:
            with self._lock:
                held.claimed = False
            return FetchReply("failed", str(e))
        if held.lease == "delete_on_consume":
            with self._lock:
                self._consumed[req.payload_id] = None
                while len(self._consumed) > _TOMBSTONES:
                    self._consumed.popitem(last=False)
            self._drop(req.payload_id)
        return FetchReply("ok")

    def _moving(self, req: FetchRequest, held: _Held, segments: Sequence) -> str | None:
        """``_move`` while the payload stays held; None if it was withdrawn before or
        during the move (the owner may reuse the bytes once its release returned, so
        a chunk read across it is not reported landed). The last move of a withdrawn
        payload lets its memory go."""
        with self._in_use(held) as usable:
            if not usable:
                return None
            path = self._move(req, held, segments)
        return None if held.dropped else path

    @contextlib.contextmanager
    def _in_use(self, held: _Held) -> Iterator[bool]:
        """While the body runs, ``held``'s registrations and staging buffer stay even
        if the payload is withdrawn (``_drop`` never waits); yields False, holding
        nothing, if it was withdrawn before. The last user of a withdrawn payload lets
        its memory go as it leaves: an error doing so is raised, or, when the body
        raised, added as a note to the body's error, which is the one raised."""
        with self._lock:
            usable = not held.dropped
            if usable:
                held.moving += 1
        if not usable:
            yield False
            return
        try:
            yield True
        except BaseException as body:
            try:
                self._end_use(held)
            except BaseException as e:
                body.add_note(f"letting the withdrawn payload's memory go also failed: {e!r}")
            raise
        self._end_use(held)

    def _end_use(self, held: _Held) -> None:
        with self._lock:
            held.moving -= 1
            last = held.dropped and not held.moving
        if last:
            self._let_go(held)

    def _await_ready(self, payload_id: str, held: _Held, chunk: int) -> bool:
        while not held.ready[chunk].wait(_READY_POLL_S):
            if self._closing.is_set() or not self.holds(payload_id):
                return False
        return self.holds(payload_id)

    def _move(self, req: FetchRequest, held: _Held, segments: Sequence) -> str:
        parts = [
            (held.regions[s.tensor].ptr + s.offset, req.addrs[s.tensor] + s.offset, s.length)
            for s in segments
        ]
        direct = held.staged is not None and held.staged.device_direct
        if self._shm_ok and req.pid and req.host and req.host == host_identity() and not direct:
            try:
                self._copy_local(req, parts)
                return "shm"
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EACCES, errno.ENOSYS):  # never here
                    self._shm_ok = False
        if parts:
            src, dst, lengths = zip(*parts, strict=True)
            self._engine.write(req.segment, src, dst, lengths)
        return "net"

    def _copy_local(self, req: FetchRequest, parts: list[tuple[int, int, int]]) -> None:
        """Same host: memcpy into the consumer's mapped shared pool where the
        destination lies in it, ``process_vm_writev`` elsewhere."""
        end = req.pool_base + req.pool_size
        pooled = [p for p in parts if req.pool_fd >= 0 and req.pool_base <= p[1] <= end - p[2]]
        rest = [p for p in parts if p not in pooled]
        if pooled:
            base = self._peer_pools.map(req.pid, req.pool_fd, req.pool_token, req.pool_size)
            for src, dst, n in pooled:
                ctypes.memmove(base + dst - req.pool_base, src, n)
        if rest:
            vm_write(req.pid, rest)

    # consumer side -----------------------------------------------------------
    def attach_pool(self, pool: SharedPool) -> None:
        """Announce this consumer's shared receive pool to producers on this host."""
        self._own_pool = pool

    def fetch(
        self,
        handle: PayloadHandle,
        regions: Sequence[Region],
        plan: Plan,
        deadline: float,
        on_chunk: Callable[[int], None],
        *,
        committed: bool = False,
    ) -> str:
        source = handle.source
        assert isinstance(source, P2PSource)
        if self._late_staging:
            self._free_late_staging(time.monotonic())
        staged = self._stager.inbound(regions)
        if staged is not None:
            regions = staged.regions
        leases = [self._engine.regs.acquire(r) for r in regions]
        same_host = self.settings.same_host and not (staged and staged.device_direct)
        try:
            pool = self._own_pool if same_host else None
            req = FetchRequest(
                handle.payload_id,
                self._engine.segment,
                tuple(r.ptr if r.nbytes else 0 for r in regions),
                tuple(r.nbytes for r in regions),
                host_identity() if same_host else "",
                os.getpid() if same_host else 0,
                pool.fd if pool else -1,
                pool.token if pool else "",
                pool.base if pool else 0,
                pool.nbytes if pool else 0,
                max(deadline - time.monotonic(), 0.001),
            )
            paths: set[str] = set()
            copying = [False]  # a copy from the staging buffer into a region was begun

            def landed(done: ChunkDone) -> None:
                paths.add(done.path)
                if staged is not None:
                    copying[0] = True  # queued device copies end only in receive()
                    staged.receive(plan[done.index])
                    copying[0] = False
                on_chunk(done.index)

            try:
                reply = self._client.call(source.endpoint, req, deadline, landed)
            except BaseException as e:  # broken off before the producer's final reply
                error = e  # the one the caller gets: this, or one that cut the wait off
                try:
                    if copying[0] and staged is not None and staged.settle():
                        copying[0] = False  # the queued device copies ended: regions are done
                except BaseException as again:  # an interrupt inside the wait: not settled
                    error = again
                    raise
                finally:
                    if staged is None or not staged.covers_all or copying[0]:  # regions written
                        setattr(error, _LATE, True)
                    if staged is not None:  # the producer may still write into its buffer
                        until = max(time.monotonic(), deadline) + self.late_write_s
                        with self._lock:
                            self._late_staging.append((until, staged))
                        staged = None
                    error = None  # no cycle through this frame's traceback
                raise
        finally:
            for lease_id in leases:
                self._engine.regs.release(lease_id)
            if staged is not None:
                staged.release()
        if reply.status == "ok":
            path = "p2p/" + ("+".join(sorted(paths)) or "net")
            return f"{path}|dst={staged.path}" if staged is not None else path
        if reply.status == "consumed":
            raise AlreadyConsumedError(reply.detail)
        if reply.status == "gone":
            raise PayloadGoneError(reply.detail)
        if reply.status == "mismatch":
            raise DestinationMismatchError(reply.detail)
        raise TransferError(f"producer {source.endpoint}: {reply.detail}")

    def may_write_late(self, error: BaseException) -> bool:
        """A fetch broken off before the producer's final reply (its deadline, the
        producer cut off, a broken frame, an interrupt): the producer may still be
        writing, and may start chunks until the fetch's deadline. Not when every
        region was staged and no copy out of the staging buffer was under way: then
        the late bytes can land only in that buffer, which this transport keeps for
        ``late_write_s`` itself (a fetch broken off inside such a copy first waits
        for the device copies it had queued; only if that wait fails as well may a
        region still be written)."""
        return getattr(error, _LATE, False) is True

    # both --------------------------------------------------------------------
    def pin(self, region: Region) -> None:
        self._engine.regs.pin(region)

    def unpin(self, region: Region) -> None:
        self._engine.regs.unpin(region)

    def registered(self) -> tuple[int, int, int]:
        regs = self._engine.regs
        return regs.count, regs.nbytes, regs.temporary

    def close(self) -> None:
        self._closing.set()
        self._client.close()
        if self._server is not None:
            self._server.close()
        with self._lock:
            ids = list(self._held)
        for payload_id in ids:
            self._drop(payload_id)
        self._peer_pools.close()  # after the server: no copy into them is running
        self._engine.close()
        self._free_late_staging(math.inf)  # the engine is gone: nothing writes any more

    def _free_late_staging(self, now: float) -> None:
        """Release the late-write staging buffers whose hold ended by ``now``."""
        with self._lock:
            ended = [staged for until, staged in self._late_staging if until <= now]
            self._late_staging = [(u, s) for u, s in self._late_staging if u > now]
        for staged in ended:
            staged.release()

"""A Mooncake Store client with typed errors and register-once buffers.

One ``StoreClient`` per process role: a pure client (``segment_bytes=0``) in
producers and consumers, a segment owner in the store host. Calls block and
release the GIL inside Mooncake; the client is safe to share between threads.

Transient results (``codes.TRANSIENT``: a read that outlived its lease, a failed
or timed-out master RPC) are retried here, only for the keys they hit, with
backoff (10 ms doubling to 200 ms) until the call's deadline (``deadline=``, a
``time.monotonic()`` value, else ``settings.store_retry_s`` from the call);
past it they raise ``TransientStoreError``. A failed or timed-out master RPC is
retried only while the master is alive: on the first one in a call the client
probes the master (TCP connect and ``/health``, within ``MASTER_PROBE_S``) and, if
it does not answer, stops retrying and raises ``MasterUnavailableError`` at once,
so a dead master costs a caller about a second, not ``store_retry_s``. Deadlines are
read off ``clock`` (``time.monotonic`` unless a test passes its own, to say when a
deadline passes without racing a loaded machine's wall time). Reads are
issued in batches of at most ``settings.store_part_bytes`` so that one batch cannot
outlive its leases; the keys of a batch that did (a loaded machine) are retried one
object per read, each under a lease of its own.

Recycling: a pure client (``segment_bytes=0``) with ``settings.store_watch_s`` > 0 is
watched (``segment_watch``): when a store host leaves the master's segment list
(killed, or lost with a restarted master) or comes back under its own segment name,
``recycle()`` builds a fresh native
client with the same config, registers the same buffers on it and swaps it in, then
closes the old one once the calls still running on it have returned. That closes
the old client's Transfer Engine sockets to the dead host, which Mooncake itself
never does. Calls made during a recycle wait for the swap (at most the fresh
client's set-up), never fail because of it. ``recycle()`` may also be called
directly.

Direct reads: a pure client (``settings.store_direct_reads``, the default) reads
objects of ``DIRECT_MIN_BYTES`` or more itself. It asks the master where their
replicas are (``batch_get_replica_desc``, which grants the same lease a get does)
and reads them with a Transfer Engine of its own, polled and paced
(``Engine.read_many``). Mooncake's own get waits for its transfer by spinning in
the calling thread (the PyPI build has no event-driven wait), a core per waiting
caller, which on a small host slows Mooncake's own TCP threads and a pipelined
producer's puts (``docs/performance.md``). A direct read that ended later than
``settings.store_lease_s`` (the master's lease, which it does not tell clients)
after its lookup is redone, as Mooncake redoes a get that outlived its lease. One
that failed, or whose object is not where a direct read can take it (no complete
memory replica of the stated size), is redone by Mooncake's get, whose result then
stands, errors included. The reader is recycled with the native client.
With ``settings.same_host`` (the default), a replica held by a store host on this
host (its endpoint's host is ``settings.local_hostname`` and a process of this PID
namespace listens on its port) is read with ``process_vm_readv`` out of that
process instead, one kernel copy where loopback TCP takes three (``samehost``);
under the same lease rule, and back to the Transfer Engine when the kernel refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from mooncake_diffusion._mooncake import gil, import_mooncake, segment_watch
from mooncake_diffusion._mooncake.codes import (
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    REPLICA_NOT_READY,
    RPC_FAIL,
    RPC_TIMEOUT,
    TRANSIENT,
    check,
    error_for,
)
from mooncake_diffusion._mooncake.engine import Engine, Read
from mooncake_diffusion._mooncake.master import probe_master
from mooncake_diffusion._mooncake.spill import spill_store_kwargs
from mooncake_diffusion.errors import MasterUnavailableError
from mooncake_diffusion.memory.registration import Registrations
from mooncake_diffusion.memory.samehost import listener_pid, vm_read
from mooncake_diffusion.platform.settings import MooncakeSettings, is_etcd_master

__all__ = ["StoreClient"]

_RETRY_MIN_S = 0.01
_RETRY_MAX_S = 0.2
#: how long the master probe after a failed RPC may take (a live master answers in ms)
MASTER_PROBE_S = 1.0
_RPC_FAULTS = frozenset({RPC_FAIL, RPC_TIMEOUT})
#: reads of at least this many bytes (one batch) are direct reads (see above); smaller
#: ones cost no more through Mooncake's get, which needs no second lookup
DIRECT_MIN_BYTES = 256 << 10
log = logging.getLogger("mooncake_diffusion.store")
#: what ``process_vm_readv`` answers when it is not allowed at all
_REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSYS)


def _batches(sizes: Sequence[Sequence[int]], limit: int) -> list[list[int]]:
    """Indices grouped in order so each group's bytes stay within ``limit`` (a larger
    single item is a group of its own; ``limit`` 0: one group)."""
    groups: list[list[int]] = []
    total = 0
    for i, parts in enumerate(sizes):
        n = sum(parts)
        if not groups or (limit and total + n > limit):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


class _Native(NamedTuple):
    """A native store client and its direct reader (``None``: reads go through it)."""

    store: Any
    reader: Engine | None


class StoreClient:
    """Connects at construction (probing the master first; fails within
    ``settings.connect_timeout_s`` if it is not there); ``close()`` when done."""

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        segment_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        spill_dir: str | None = None,
    ) -> None:
        self._mod = import_mooncake("store")
        #: a segment owner's disk tier (``_mooncake/spill.py``); ``None``: DRAM only
        self._spill = spill_store_kwargs(spill_dir) if spill_dir else {}
        self._settings = settings
        self._segment_bytes = segment_bytes
        probe_master(settings)
        self._direct = segment_bytes == 0 and settings.store_direct_reads
        #: a direct read that ended later than this after its lookup is redone
        self.lease_s = settings.store_lease_s
        self._devices: dict[int, str] = {}  # registered extents' devices (for recycles)
        self._native = self._connect()
        self.regs = Registrations(self._register, self._unregister)
        self._part_bytes = settings.store_part_bytes
        self._retry_s = settings.store_retry_s
        self._clock = clock
        self._probe_settings = dataclasses.replace(
            settings, connect_timeout_s=min(MASTER_PROBE_S, settings.connect_timeout_s)
        )
        #: transient results retried so far (per key and attempt), for tests and metrics
        self.retries = 0
        #: master probes after a failed RPC, and how many found it down (tests, metrics)
        self.master_probes = 0
        self.master_down = 0
        #: native clients replaced by ``recycle()`` (tests, metrics)
        self.recycles = 0
        #: objects read directly, and those a direct read handed to Mooncake's get
        self.direct_reads = 0
        self.direct_fallbacks = 0
        #: direct reads done out of a store host on this host (``process_vm_readv``)
        self.local_reads = 0
        self._same_host = self._direct and settings.same_host
        self._store_hosts: dict[str, int | None] = {}  # endpoint -> its local pid
        # the native client in use and the calls running on each one (by generation)
        self._cv = threading.Condition()
        self._generation = 0
        self._users: dict[int, int] = {0: 0}
        self._retired: dict[int, Any] = {}
        self._recycling = threading.Lock()
        self._closed = False
        if segment_bytes == 0 and settings.store_watch_s > 0:
            segment_watch.watch(self, settings.admin_address, settings.store_watch_s)

    def _connect(self) -> _Native:
        """A native client set up against the master (``MasterUnavailableError`` if not),
        with its direct reader when direct reads are on."""
        s = self._settings
        store = self._mod.MooncakeDistributedStore()
        rc = store.setup(
            s.local_hostname,
            "P2PHANDSHAKE",
            self._segment_bytes,
            0,
            s.protocol,
            s.device,
            s.master,
            **self._spill,
        )
        if rc != 0:
            raise MasterUnavailableError(
                f"Mooncake Store setup against master {s.master} failed ({rc})"
            )
        try:
            reader = Engine(s) if self._direct else None
        except Exception:
            with gil.holding("store client close"):
                store.close()
            raise
        return _Native(store, reader)

    @contextlib.contextmanager
    def _use(self) -> Iterator[_Native]:
        """The native client for one call; a recycle closes it only after this returns."""
        with self._cv:
            gen, native = self._generation, self._native
            self._users[gen] += 1
        try:
            yield native
        finally:
            with self._cv:
                self._users[gen] -= 1
                last = gen != self._generation and self._users[gen] == 0
                retired = self._retired.pop(gen, None) if last else None
                self._cv.notify_all()
            if retired is not None:
                self._close_native(retired)

    def _call(self, method: str, *args: Any) -> Any:
        """The native client's ``method`` called with ``args`` (on the client in use:
        see ``_use``)."""
        with self._use() as native:
            return getattr(native.store, method)(*args)

    def recycle(self, reason: str = "asked") -> bool:
        """Replace the native client with a fresh one of the same config: the same
        buffers registered, then swapped in; the old one is closed (its sockets with
        it) once no call runs on it, here or by the last such call. Thread-safe; a
        pure client only (a segment owner's pool would die with its client). Returns
        ``False`` when it could not be done now (closed, or the master does not
        answer: the old client stays in use)."""
        if self._segment_bytes:
            raise ValueError("a store client that owns a segment cannot be recycled")
        with self._recycling:
            if self._closed:
                return False
            try:
                probe_master(self._probe_settings)
                fresh = self._connect()
            except MasterUnavailableError as e:
                log.info("store client not recycled yet (%s): %s", reason, e)
                return False
            with self.regs.held() as extents:
                done: list[tuple[int, int]] = []
                try:
                    for ptr, nbytes in extents:
                        self._register_on(fresh, ptr, nbytes, self._devices.get(ptr, "cpu"))
                        done.append((ptr, nbytes))
                except Exception:
                    self._close_native((fresh, done))
                    raise
                with self._cv:
                    old, gen = self._native, self._generation
                    self._native = fresh
                    self._generation += 1
                    self._users[self._generation] = 0
                    busy = self._users[gen] > 0
                    if busy:
                        self._retired[gen] = (old, extents)
                    else:
                        del self._users[gen]
            self.recycles += 1
            log.warning("store client recycled: %s", reason)
            if not busy:
                self._close_native((old, extents))
            return True

    @staticmethod
    def _close_native(retired: tuple[_Native, list[tuple[int, int]]]) -> None:
        """Unregister ``extents`` from a native client and its reader and close both,
        one after the other: each keeps the GIL for about a second inside Mooncake
        (side by side they would only queue for it), and ``gil.holding`` lets a
        worker send its heartbeat before each."""
        (store, reader), extents = retired
        for ptr, _ in extents:
            with contextlib.suppress(Exception):
                store.unregister_buffer(ptr)
            if reader is not None:
                with contextlib.suppress(Exception):
                    reader.unregister_extent(ptr)
        if reader is not None:
            reader.close()
        with gil.holding("store client close"), contextlib.suppress(Exception):
            store.close()

    @staticmethod
    def _register_on(native: _Native, ptr: int, nbytes: int, device: str) -> None:
        check(native.store.register_buffer(ptr, nbytes), "store register_buffer")
        if native.reader is not None:
            try:
                native.reader.register_extent(ptr, nbytes, device)
            except Exception:
                native.store.unregister_buffer(ptr)
                raise

    def _deadline(self, deadline: float | None) -> float:
        return self._clock() + self._retry_s if deadline is None else deadline

    def _retrying(
        self,
        n: int,
        call: Callable[[list[int]], Sequence[int]],
        deadline: float | None,
        *,
        split: bool = False,
    ) -> list[int]:
        """Run ``call`` on item indices ``0..n-1`` (it returns one code per index given),
        then again on those with a transient code until none is left or ``deadline``
        passes. Returns every index's last code (still transient past the deadline).
        ``split``: each retry calls ``call`` once per index (reads: the keys of one
        batched read share one lease grant, so a batch that outlived its leases would
        likely outlive them again, every time, on a loaded machine).

        Raises ``MasterUnavailableError`` when an RPC failed and the probe that follows
        the first such failure finds the master down (no retry can succeed then)."""
        end = self._deadline(deadline)
        final = [0] * n
        todo = list(range(n))
        delay = _RETRY_MIN_S
        probed = False
        calls = [todo]  # the first try as one batch; with ``split``, retries one by one
        while True:
            for idx in calls:
                for i, code in zip(idx, call(idx), strict=True):
                    final[i] = code
            todo = [i for i in todo if final[i] in TRANSIENT]
            calls = [[i] for i in todo] if split else [todo]
            if not todo or self._clock() + delay > end:
                return final
            if not probed and any(final[i] in _RPC_FAULTS for i in todo):
                probed = True
                self._probe_master(final[todo[0]])
            self.retries += len(todo)
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    def _probe_master(self, code: int) -> None:
        """After a failed master RPC (``code``): return if the master answers, else
        raise ``MasterUnavailableError`` saying so. Under master HA (``etcd://``) it
        returns either way: a standby takes over, so the call is retried."""
        self.master_probes += 1
        try:
            probe_master(self._probe_settings)
        except MasterUnavailableError as e:
            self.master_down += 1
            if is_etcd_master(self._settings.master):
                return  # HA: a standby takes over (lease + warm-up); retried to the deadline
            raise MasterUnavailableError(
                f"{error_for(code, 'a store call')}; the master does not answer, so it is "
                f"not retried: {e}"
            ) from None

    def _register(self, ptr: int, nbytes: int, device: str) -> None:
        with self._use() as native:
            self._register_on(native, ptr, nbytes, device)
        self._devices[ptr] = device

    def _unregister(self, ptr: int) -> None:
        self._devices.pop(ptr, None)
        with self._use() as native:
            check(native.store.unregister_buffer(ptr), "store unregister_buffer")
            if native.reader is not None:
                native.reader.unregister_extent(ptr)

    def _config(self, pin: str) -> object:
        cfg = self._mod.ReplicateConfig()
        if pin == "hard":
            cfg.with_hard_pin = True
        elif pin == "soft":
            if hasattr(cfg, "soft_pin_action"):  # Mooncake >= 0.3.13
                cfg.soft_pin_action = self._mod.SoftPinAction.ENABLE
            else:
                cfg.with_soft_pin = True
        return cfg

    def put_many(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        pin: str,
        deadline: float | None = None,
    ) -> None:
        """Store under ``keys[i]`` the bytes of registered buffers ``ptrs[i]`` (sizes
        ``sizes[i]``), gathered in order into one object; all or nothing.

        ``pin`` is ``"hard"`` (never evicted), ``"soft"`` (evicted last) or
        ``"none"``. Transient faults are retried until ``deadline``. On any other
        failure the keys that did land are removed and the first error is raised
        (``StoreFullError`` when the pool is full).
        """
        if not keys:
            return
        codes = self._put_codes(keys, ptrs, sizes, pin, deadline)
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if failed:
            self.remove_many([k for k, c in zip(keys, codes, strict=True) if c >= 0])
            key, code = failed[0]
            raise error_for(code, f"store put of {key!r}")

    def put_each(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        pin: str,
        deadline: float | None = None,
    ) -> list[bool]:
        """``put_many`` that answers per key instead of all or nothing: ``True`` when
        the store took it (written, or already there: Mooncake leaves an existing
        key as it is and may say nothing, so it may be another writer's), ``False``
        when the pool had no room for it. Removes nothing; any other failure raises.
        Transient faults are retried until ``deadline``."""
        out = []
        for key, code in zip(keys, self._put_codes(keys, ptrs, sizes, pin, deadline), strict=True):
            if code == NO_AVAILABLE_HANDLE:
                out.append(False)
            elif code >= 0 or code == OBJECT_ALREADY_EXISTS:
                out.append(True)
            else:
                raise error_for(code, f"store put of {key!r}")
        return out

    def _put_codes(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        pin: str,
        deadline: float | None,
    ) -> list[int]:
        """One batched put, retried on transient codes; each key's last code."""
        if not keys:
            return []
        cfg = self._config(pin)

        def put(idx: list[int]) -> Sequence[int]:
            return self._call(
                "batch_put_from_multi_buffers",
                [keys[i] for i in idx],
                [list(ptrs[i]) for i in idx],
                [list(sizes[i]) for i in idx],
                cfg,
            )

        return self._retrying(len(keys), put, deadline)

    def remove_each(self, keys: Sequence[str]) -> list[bool]:
        """One ``batch_remove`` with force and no retry: per key, whether this call
        removed it (of any number of callers racing on a key, exactly one gets
        ``True``). Any other code raises, a transient one too: the master may have
        removed the key, so the outcome is unknown and the caller must not guess."""
        if not keys:
            return []
        out = []
        for key, code in zip(keys, self._call("batch_remove", list(keys), True), strict=True):
            if code < 0 and code != OBJECT_NOT_FOUND:
                raise error_for(code, f"store remove of {key!r} (outcome unknown)")
            out.append(code >= 0)
        return out

    def get_many(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        deadline: float | None = None,
    ) -> list[bool]:
        """Read each key, scattered in order into registered buffers ``ptrs[i]``
        (sizes ``sizes[i]``); ``False`` where the key is absent or still being put.

        Reads go in batches of at most ``store_part_bytes``, direct ones from
        ``DIRECT_MIN_BYTES`` a batch (see the module's docstring); transient faults
        are retried until ``deadline``. Any other failure raises (``PeerGoneError``
        when the store host died).
        """
        if not keys:
            return []
        codes: list[int] = []
        for group in _batches(sizes, self._part_bytes):

            def get(idx: list[int], group: list[int] = group) -> Sequence[int]:
                k = [keys[group[i]] for i in idx]
                p = [list(ptrs[group[i]]) for i in idx]
                n = [list(sizes[group[i]]) for i in idx]
                with self._use() as native:
                    if native.reader is not None and sum(map(sum, n)) >= DIRECT_MIN_BYTES:
                        return self._read_direct(native, k, p, n)
                    return native.store.batch_get_into_multi_buffers(k, p, n)

            codes += self._retrying(len(group), get, deadline, split=True)
        found = []
        for key, code in zip(keys, codes, strict=True):
            if code in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
                found.append(False)
            else:
                check(code, f"store get of {key!r}")
                found.append(True)
        return found

    def _read_direct(
        self, native: _Native, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        """One try of ``get_many``'s read of ``keys`` by direct reads; a code per key as
        Mooncake's get gives them (see the module's docstring)."""
        assert native.reader is not None
        start = time.monotonic()
        where = native.store.batch_get_replica_desc(keys)
        # an empty answer may be a failed lookup: Mooncake's get tells which
        codes = [OBJECT_NOT_FOUND if where else 0] * len(keys)
        fallback = [] if where else list(range(len(keys)))
        reads: list[Read] = []
        read_idx: list[int] = []
        for i, key in enumerate(keys):
            replicas = where.get(key, ())
            desc = _memory_replica(replicas)
            if desc is None:
                if replicas:  # only on disk (spilled), or not complete: Mooncake's get says
                    fallback.append(i)
                continue  # absent: OBJECT_NOT_FOUND, as set above
            if desc.size != sum(sizes[i]):
                fallback.append(i)  # Mooncake's get says what is wrong
                continue
            dst, src = [], []
            offset = 0
            for ptr, n in zip(ptrs[i], sizes[i], strict=True):
                if n:
                    dst.append(ptr)
                    src.append(desc.buffer_address + offset)
                offset += n
            reads.append((desc.transport_endpoint, dst, src, [n for n in sizes[i] if n]))
            read_idx.append(i)
        ends = [0] * len(reads)
        net = [
            j for j, read in enumerate(reads) if not (self._same_host and self._read_local(read))
        ]
        if net:
            for j, end in zip(net, native.reader.read_many([reads[j] for j in net]), strict=True):
                ends[j] = end
        late = time.monotonic() - start > self.lease_s
        for i, end in zip(read_idx, ends, strict=True):
            if end < 0:
                fallback.append(i)
            else:
                codes[i] = LEASE_EXPIRED if late else sum(sizes[i])
                self.direct_reads += 1
        if fallback:
            fallback.sort()
            self.direct_fallbacks += len(fallback)
            redone = native.store.batch_get_into_multi_buffers(
                [keys[i] for i in fallback],
                [ptrs[i] for i in fallback],
                [sizes[i] for i in fallback],
            )
            for i, code in zip(fallback, redone, strict=True):
                codes[i] = code
        return codes

    def _read_local(self, read: Read) -> bool:
        """Do ``read`` out of a store host on this host; ``False`` when it is not one
        or the copy failed (then the caller reads over the network; an endpoint whose
        copies the kernel refuses stays there)."""
        endpoint, dst, src, lengths = read
        pid = self._store_hosts.get(endpoint, -1)  # (threads may race here: no harm)
        if pid == -1:
            host, _, port = endpoint.rpartition(":")
            local = host == self._settings.local_hostname and port.isdigit()
            pid = self._store_hosts[endpoint] = listener_pid(int(port)) if local else None
        if pid is None:
            return False
        try:
            vm_read(pid, list(zip(dst, src, lengths, strict=True)))
        except OSError as e:
            if e.errno == errno.ESRCH:  # it died; one may come back on the port: look again
                self._store_hosts.pop(endpoint, None)
            elif e.errno in _REFUSED:  # the kernel will not let this process: stop asking
                self._store_hosts[endpoint] = None
            # else (EFAULT: a destination in device memory, say) only this read goes by net
            log.info("store read out of %s (pid %d) on this host failed: %s", endpoint, pid, e)
            return False
        self.local_reads += 1
        return True

    def read(
        self,
        key: str,
        ptr: int,
        capacity: int,
        *,
        deadline: float | None = None,
        ready_by: float | None = None,
    ) -> int | None:
        """Read object ``key`` of unknown size into registered memory at ``ptr`` that
        holds ``capacity`` bytes; returns its size, or ``None`` when the key is absent
        or still being put (``ready_by``, a ``time.monotonic()``: a put still in flight
        is waited for until then). An object larger than ``capacity`` raises
        ``MooncakeError``; any other failure raises as in ``get_many``. One round trip,
        no size query (more only when a transient fault is retried, until
        ``deadline``, or a put in flight waited for)."""
        while True:
            (code,) = self._retrying(
                1, lambda _i: [self._call("get_into", key, ptr, capacity)], deadline
            )
            if code == REPLICA_NOT_READY and ready_by is not None and time.monotonic() < ready_by:
                time.sleep(0.001)
                continue
            if code in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
                return None
            return check(code, f"store read of {key!r}")

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in the store (one round trip, more only to retry transient
        faults); any other failure raises."""
        if not keys:
            return []
        codes = self._retrying(
            len(keys), lambda idx: self._call("batch_is_exist", [keys[i] for i in idx]), None
        )
        found = []
        for key, code in zip(keys, codes, strict=True):
            found.append(check(code, f"store existence check of {key!r}") == 1)
        return found

    def sizes_of(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's size in bytes, ``None`` for one absent (or still being put); one
        round trip per key (for inspection, not the data path)."""
        out: list[int | None] = []
        for key in keys:
            n = self._call("get_size", key)
            out.append(n if n >= 0 else None)
        return out

    def remove_many(self, keys: Sequence[str]) -> None:
        """Remove keys with force (leases granted by reads do not block); absent keys
        are fine; transient faults are retried."""
        if not keys:
            return
        codes = self._retrying(
            len(keys), lambda idx: self._call("batch_remove", [keys[i] for i in idx], True), None
        )
        for key, code in zip(keys, codes, strict=True):
            if code < 0 and code != OBJECT_NOT_FOUND:
                raise error_for(code, f"store remove of {key!r}")

    def claim(self, key: str, *, also: Sequence[str] = ()) -> bool:
        """Remove ``key`` with force and say whether this call removed it: ``True`` for
        exactly one of any number of callers racing on one key (the master removes an
        object once; the others get OBJECT_NOT_FOUND), ``False`` when it was absent.
        ``also``: keys removed in the same round trip whatever their outcome."""
        codes = self._call("batch_remove", [key, *also], True)
        code = codes[0]
        if code == OBJECT_NOT_FOUND:
            return False
        check(code, f"store remove of {key!r}")
        return True

    def remove_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix`` (with force); returns how many."""
        return self.remove_regex("^" + re.escape(prefix))

    def remove_regex(self, pattern: str) -> int:
        """Remove every key matching the regular expression ``pattern`` (with force;
        one scan of the master's keys); returns how many."""
        return max(self._call("remove_by_regex", pattern, True), 0)

    def close(self, *, _exiting: Callable[[], bool] = sys.is_finalizing) -> None:
        """Unregister buffers and disconnect (about 1 s inside Mooncake). Idempotent.

        Safe from a finalizer at interpreter exit (an owner left to ``__del__``):
        once the interpreter is tearing down (``sys.is_finalizing()``, after the
        ``atexit`` hooks) the modules' globals may already read ``None``, so only the
        native clients this object holds are closed, by their own methods; the watch
        thread was stopped by then (``segment_watch``'s ``atexit`` hook), and buffer
        registrations end with the native client."""
        if self._closed:
            return
        if _exiting():
            self._closed = True
            natives = [self._native, *(n for n, _ in self._retired.values())]
            self._retired = {}
            for native in natives:
                # not contextlib.suppress: this module's globals may read None by now
                try:  # noqa: SIM105
                    native.store.close()
                except Exception:
                    pass
            return
        segment_watch.unwatch(self)  # first: a recycle in progress finishes
        with self._recycling:
            self._closed = True
        self.regs.close()
        with self._cv:
            retired = list(self._retired.values())
            self._retired.clear()
        for r in retired:
            self._close_native(r)
        self._close_native((self._native, []))


def _memory_replica(replicas: Sequence[Any]) -> Any | None:
    """The buffer descriptor of the first complete memory replica, if any."""
    for r in replicas:
        if r.is_memory_replica() and r.status.name == "COMPLETE":
            return r.get_memory_descriptor().buffer_descriptor
    return None

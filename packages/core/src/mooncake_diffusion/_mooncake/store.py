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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mooncake_diffusion._mooncake import import_mooncake, segment_watch
from mooncake_diffusion._mooncake.codes import (
    OBJECT_NOT_FOUND,
    REPLICA_NOT_READY,
    RPC_FAIL,
    RPC_TIMEOUT,
    TRANSIENT,
    check,
    error_for,
)
from mooncake_diffusion._mooncake.master import probe_master
from mooncake_diffusion.errors import MasterUnavailableError
from mooncake_diffusion.registration import Registrations
from mooncake_diffusion.settings import MooncakeSettings

__all__ = ["StoreClient"]

_RETRY_MIN_S = 0.01
_RETRY_MAX_S = 0.2
#: how long the master probe after a failed RPC may take (a live master answers in ms)
MASTER_PROBE_S = 1.0
_RPC_FAULTS = frozenset({RPC_FAIL, RPC_TIMEOUT})
log = logging.getLogger("mooncake_diffusion.store")


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


class StoreClient:
    """Connects at construction (probing the master first; fails within
    ``settings.connect_timeout_s`` if it is not there); ``close()`` when done."""

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        segment_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mod = import_mooncake("store")
        self._settings = settings
        self._segment_bytes = segment_bytes
        probe_master(settings)
        self._store = self._connect()
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
        # the native client in use and the calls running on each one (by generation)
        self._cv = threading.Condition()
        self._generation = 0
        self._users: dict[int, int] = {0: 0}
        self._retired: dict[int, Any] = {}
        self._recycling = threading.Lock()
        self._closed = False
        if segment_bytes == 0 and settings.store_watch_s > 0:
            segment_watch.watch(self, settings.admin_address, settings.store_watch_s)

    def _connect(self) -> Any:
        """A native client set up against the master (``MasterUnavailableError`` if not)."""
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
        )
        if rc != 0:
            raise MasterUnavailableError(
                f"Mooncake Store setup against master {s.master} failed ({rc})"
            )
        return store

    @contextlib.contextmanager
    def _use(self) -> Iterator[Any]:
        """The native client for one call; a recycle closes it only after this returns."""
        with self._cv:
            gen, store = self._generation, self._store
            self._users[gen] += 1
        try:
            yield store
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
        with self._use() as store:
            return getattr(store, method)(*args)

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
                try:
                    for ptr, nbytes in extents:
                        check(fresh.register_buffer(ptr, nbytes), "store register_buffer")
                except Exception:
                    self._close_native(fresh)
                    raise
                with self._cv:
                    old, gen = self._store, self._generation
                    self._store = fresh
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
    def _close_native(retired: tuple[Any, list[tuple[int, int]]]) -> None:
        store, extents = retired
        for ptr, _ in extents:
            with contextlib.suppress(Exception):
                store.unregister_buffer(ptr)
        with contextlib.suppress(Exception):
            store.close()

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
        raise ``MasterUnavailableError`` saying so."""
        self.master_probes += 1
        try:
            probe_master(self._probe_settings)
        except MasterUnavailableError as e:
            self.master_down += 1
            raise MasterUnavailableError(
                f"{error_for(code, 'a store call')}; the master does not answer, so it is "
                f"not retried: {e}"
            ) from None

    def _register(self, ptr: int, nbytes: int, device: str) -> None:
        check(self._call("register_buffer", ptr, nbytes), "store register_buffer")

    def _unregister(self, ptr: int) -> None:
        check(self._call("unregister_buffer", ptr), "store unregister_buffer")

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
        cfg = self._config(pin)

        def put(idx: list[int]) -> Sequence[int]:
            return self._call(
                "batch_put_from_multi_buffers",
                [keys[i] for i in idx],
                [list(ptrs[i]) for i in idx],
                [list(sizes[i]) for i in idx],
                cfg,
            )

        codes = self._retrying(len(keys), put, deadline)
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if failed:
            self.remove_many([k for k, c in zip(keys, codes, strict=True) if c >= 0])
            key, code = failed[0]
            raise error_for(code, f"store put of {key!r}")

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

        Reads go in batches of at most ``store_part_bytes``; transient faults are
        retried until ``deadline``. Any other failure raises (``PeerGoneError``
        when the store host died).
        """
        if not keys:
            return []
        codes: list[int] = []
        for group in _batches(sizes, self._part_bytes):

            def get(idx: list[int], group: list[int] = group) -> Sequence[int]:
                return self._call(
                    "batch_get_into_multi_buffers",
                    [keys[group[i]] for i in idx],
                    [list(ptrs[group[i]]) for i in idx],
                    [list(sizes[group[i]]) for i in idx],
                )

            codes += self._retrying(len(group), get, deadline, split=True)
        found = []
        for key, code in zip(keys, codes, strict=True):
            if code in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
                found.append(False)
            else:
                check(code, f"store get of {key!r}")
                found.append(True)
        return found

    def read(
        self, key: str, ptr: int, capacity: int, *, deadline: float | None = None
    ) -> int | None:
        """Read object ``key`` of unknown size into registered memory at ``ptr`` that
        holds ``capacity`` bytes; returns its size, or ``None`` when the key is absent
        or still being put. An object larger than ``capacity`` raises ``MooncakeError``;
        any other failure raises as in ``get_many``. One round trip, no size query
        (more only when a transient fault is retried, until ``deadline``)."""
        (code,) = self._retrying(
            1, lambda _i: [self._call("get_into", key, ptr, capacity)], deadline
        )
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

    def close(self) -> None:
        """Unregister buffers and disconnect (about 1 s inside Mooncake). Idempotent."""
        if self._closed:
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
        self._store.close()

"""A mailbox in Mooncake Store: small records posted and taken by name alone.

Engines whose runtime hands a consumer nothing but a key (vLLM-Omni's
connectors, whose ``put()`` metadata the runtime drops) need the producer to
leave the payload's handle where the consumer can find it from that key. A
mailbox is that place: a record of at most ``max_record`` bytes stored under
``namespace + name``, hard-pinned (never evicted before it is taken).

Call sequence:

    box = Mailbox(settings)                  # connects; fails fast without a master
    old = box.post(name, record, expires_at=t, replace=True)  # producer
    record = box.take(name)                  # consumer: the bytes, or None at once
    record = box.take_until(name, deadline)  # the same, waiting until deadline (monotonic)
    box.discard(name); box.discard_prefix(p) # cleanup from either side
    box.close()

``take`` reads the record in one round trip (no size query: the record lands
in a registered scratch) and then claims it by removing it with force: the
master removes an object once, so of any number of takers racing on one name,
in any processes, exactly one gets the record and the others get ``None`` (as
if they had come after). ``post`` of a name whose record is still there
raises ``DuplicatePublishError``, or with ``replace=True`` takes the old
record first and returns it (the caller frees what it referred to), as a
shared-memory segment written again under its name.

Expiry. A record posted with ``expires_at`` (unix seconds) is stored with an
8-byte header holding that time in ms, and beside it, in the same batch, a
one-byte marker ``leases.ttl_marker(expires_ms, key)`` whose name carries the
expiry: any process listing the store's keys (``leases.Reaper``: the store
host's, or one a ``KeyedHandoff`` runs) removes the record and its marker once
the time has passed, without reading either, so records of a producer that
crashed are reclaimed too. ``take`` removes the marker with the record in the
same round trip; a taker gets the record whether or not it expired (the
caller decides; ``expires_at_of`` reads the header).

Claims under a lease. ``claim(name, lease_s)`` is ``take`` for a record whose
taker still has work to do before the record may go (a transfer of the bytes
it names): it takes the record as ``take`` does (exactly one taker wins) and
then posts it under ``lease_namespace + name`` with the time the lease lapses.
``Claim.confirm()`` (the work is done) removes the lease; ``Claim.give_back()``
posts the record under its name again. A lease that lapsed (its taker died or
stalled) is taken over by the next ``claim`` of that name: of any number of
claimers exactly one wins it, gets the record and leases it anew. So a record
goes to exactly one live taker, and to at least one across takers' deaths. The
one window left is the round trip between the take and the lease's post: a
taker dying there loses the record (its expiry still reclaims what it named).
A claim of an absent name costs one round trip (one existence check of the
record and its lease), as a ``take`` does.

A full pool. The lease's post needs room the take has just freed, and another
put (a producer filling the pool) may have had it meanwhile. The post is then
retried for up to a second; a pool still full after that gets the record
without a lease (``unleased_claims`` counts these, and a warning says so): the
taker has it in hand and consuming what it names frees room, where waiting on
the pool could wait forever and a give-back into a full pool would drop it. For
that one record a taker dying before it is done loses it (its expiry still
reclaims what it named).

Concurrent posts. A put of an existing key may report success without writing,
so every ``post`` reads its record back: one that finds another poster's
record there (two producers posting one name at the same instant) raises
``DuplicatePublishError``, also with ``replace`` (the caller frees what its
record named), and the other post stands. So of two posts racing on one name
one succeeds and at most one fails, and nothing of the failed one stays in the
store. ``replace`` takes only a record that was there before the post began.

Thread-safe: posts and takes each serialise on their own scratch; a take costs
~0.1 ms when the name is absent and one small read plus a remove when present.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from mooncake_diffusion._mooncake.codes import OBJECT_ALREADY_EXISTS
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import (
    DuplicatePublishError,
    MooncakeDiffusionError,
    MooncakeError,
    PayloadError,
    StoreFullError,
)
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.leases import TTL_ROOT, ttl_marker

__all__ = ["DEFAULT_MAX_RECORD", "MAILBOX_ROOT", "Claim", "Mailbox"]

#: Where records live unless a mailbox is given another namespace.
MAILBOX_ROOT = "mcd-mbox/"
DEFAULT_MAX_RECORD = 1 << 20
_MAX_NAME = 1024
_HEADER = struct.Struct("<Q")  # expires_ms, 0: never
# a lease record's body starts with the ms its lease lapses at and its claimer's token
_LEASE = struct.Struct("<Q16s")
_REPLACE_TRIES = 8
_READ_BACK_S = 5.0  # how long a post's read back waits for another's put in flight
_FULL_LEASE_S = 1.0  # how long a claim retries its lease's post into a full pool
_log = logging.getLogger("mooncake_diffusion.mailbox")
T = TypeVar("T")


class Claim:
    """A record claimed under a lease (``Mailbox.claim``): ``record`` holds its bytes,
    ``expires_at`` its expiry (unix seconds, or ``None``). Call exactly one of
    ``confirm`` or ``give_back`` once the work the record names is done or failed."""

    def __init__(
        self,
        box: Mailbox,
        name: str,
        record: bytes,
        expires_ms: int,
        leased: bool,
        token: bytes = b"",
    ) -> None:
        self.name = name
        self.record = record
        self.expires_at = expires_ms / 1000 if expires_ms else None
        self._box = box
        self._expires_ms = expires_ms
        self._leased = leased
        self._token = token

    def confirm(self) -> bool:
        """Remove the lease: the record is consumed. ``False`` when the lease was no
        longer there (it lapsed and another claimer took the record over, or it was
        discarded): the caller then leaves what the record names to that one."""
        if not self._leased:
            return True
        self._leased = False
        return self._box._end_lease(self.name, self._token)

    def give_back(self) -> bool:
        """Post the record under its name again (a later claim retries) and remove the
        lease; ``False`` when that failed (another record was posted meanwhile, or the
        store refused), in which case the lease is removed all the same and the caller
        frees what the record names."""
        try:
            self._box.post(self.name, self.record, expires_at=self.expires_at)
            ok = True
        except MooncakeDiffusionError as e:
            _log.warning("could not give back the record under %r: %s", self.name, e)
            ok = False
        if self._leased:
            self._leased = False
            self._box._end_lease(self.name, self._token)
        return ok


class Mailbox:
    """Named records in Mooncake Store (see the module docstring).

    ``client`` may be shared (it is then left open by ``close``); otherwise the
    mailbox makes its own, which probes the master first and raises
    ``MasterUnavailableError`` within ``settings.connect_timeout_s``.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        namespace: str = MAILBOX_ROOT,
        max_record: int = DEFAULT_MAX_RECORD,
        client: StoreClient | None = None,
    ) -> None:
        if max_record <= 0:
            raise PayloadError(f"max_record must be positive, got {max_record}")
        self.namespace = namespace
        #: where records claimed under a lease wait for their taker's confirmation
        self.lease_namespace = namespace.rstrip("/") + "-lease/"
        self.max_record = max_record
        self._own_client = client is None
        # records are read with ``read()``, never directly: no second Transfer Engine
        self._client = (
            client
            if client is not None
            else StoreClient(dataclasses.replace(settings, store_direct_reads=False))
        )
        room = max_record + _HEADER.size + _LEASE.size
        self._out = np.empty(room, dtype=np.uint8)
        self._in = np.empty(room, dtype=np.uint8)
        self._out_lock = threading.Lock()
        self._in_lock = threading.Lock()
        self._closed = False
        #: claims that went on without a lease because the pool stayed full
        self.unleased_claims = 0
        try:
            for buf in (self._out, self._in):
                self._client.regs.pin(describe("mailbox", buf)[1])
        except BaseException:
            self.close()
            raise

    def key_of(self, name: str) -> str:
        """The store key of ``name``'s record."""
        if not 0 < len(name) <= _MAX_NAME:
            raise PayloadError(f"mailbox names are 1..{_MAX_NAME} characters, got {len(name)}")
        return self.namespace + name

    def lease_key_of(self, name: str) -> str:
        """The store key of ``name``'s record while it is claimed under a lease."""
        return self.lease_namespace + self.key_of(name)[len(self.namespace) :]

    def post(
        self,
        name: str,
        record: bytes | bytearray | memoryview,
        *,
        expires_at: float | None = None,
        replace: bool = False,
    ) -> bytes | None:
        """Store ``record`` under ``name`` (hard-pinned), expiring at ``expires_at`` (unix
        seconds; see the module docstring) when given. Returns the record it replaced
        (``replace=True``) or ``None``. Raises ``PayloadError`` when it exceeds
        ``max_record``, ``DuplicatePublishError`` when ``name`` holds a record and
        ``replace`` is false, or another poster put one at the same instant (see
        "Concurrent posts"), and the store's errors (``StoreFullError``, ...)
        otherwise. Returns only once the record under ``name`` was read back as this
        one."""
        key = self.key_of(name)
        n = len(record)
        if not 0 < n <= self.max_record:
            raise PayloadError(f"a mailbox record is 1..{self.max_record} bytes, got {n}")
        expires_ms = int(expires_at * 1000) if expires_at is not None else 0
        mine = bytes(record)
        replaced = None
        for _ in range(_REPLACE_TRIES):
            # a put of an existing key may report success without writing: check first
            if self._client.exists_many([key])[0]:
                if not replace:
                    break
                old = self.take(name)
                replaced = old if old is not None else replaced
                continue
            wrote = self._put(key, expires_ms, mine)
            there = self._read(key, ready_by=time.monotonic() + _READ_BACK_S)
            if wrote and (there is None or there == (expires_ms, mine)):
                return replaced  # ours (None: a taker was quicker than the read back)
            # another poster's record is there: ours was never written, or a replace
            # took it (and frees what it named). Either way the other one stands; our
            # marker, if it differs from theirs, is all of ours left in the store
            if expires_ms and (there is None or there[0] != expires_ms):
                self._client.remove_many([ttl_marker(expires_ms, key)])
            raise DuplicatePublishError(
                f"mailbox name {name!r}: another record was posted there at the same time"
            )
        raise DuplicatePublishError(f"mailbox name {name!r} already holds a record")

    def _put(self, key: str, expires_ms: int, body: bytes) -> bool:
        """Put ``body`` under ``key`` with its header and expiry marker; ``False`` when
        the store said the key exists."""
        keys = [key, ttl_marker(expires_ms, key)] if expires_ms else [key]
        n = len(body)
        with self._out_lock:
            _HEADER.pack_into(self._out, 0, expires_ms)
            self._out[_HEADER.size : _HEADER.size + n] = np.frombuffer(body, np.uint8)
            base = self._out.ctypes.data
            sizes = [[_HEADER.size + n], [1]][: len(keys)]
            try:
                self._client.put_many(keys, [[base]] * len(keys), sizes, pin="hard")
            except MooncakeError as e:
                if e.code == OBJECT_ALREADY_EXISTS:
                    return False
                raise
        return True

    def peek(self, name: str) -> bytes | None:
        """The record under ``name`` without taking it, or ``None`` at once."""
        got = self._read(self.key_of(name))
        return None if got is None else got[1]

    def _read(self, key: str, ready_by: float | None = None) -> tuple[int, bytes] | None:
        with self._in_lock:
            n = self._client.read(key, self._in.ctypes.data, len(self._in), ready_by=ready_by)
            if n is None:
                return None
            if n < _HEADER.size:
                raise PayloadError(f"mailbox record {key!r} has no header ({n} bytes)")
            (expires_ms,) = _HEADER.unpack_from(self._in, 0)
            return expires_ms, self._in[_HEADER.size : n].tobytes()

    def _take_key(self, key: str) -> tuple[int, bytes] | None:
        """Read and remove ``key`` (and its expiry marker); ``None`` when absent or a
        racing taker removed it first."""
        got = self._read(key)
        if got is None:
            return None
        also = [ttl_marker(got[0], key)] if got[0] else []
        if not self._client.claim(key, also=also):
            return None
        return got

    def take(self, name: str) -> bytes | None:
        """Read and remove the record under ``name`` (and its expiry marker); ``None`` at
        once when absent or when a racing taker removed it first (exactly one taker
        gets each record)."""
        got = self._take_key(self.key_of(name))
        return None if got is None else got[1]

    def take_until(self, name: str, deadline: float) -> bytes | None:
        """``take`` polled with bounded backoff (0.5 ms doubling to 20 ms) until
        ``deadline`` (``time.monotonic()``); ``None`` if nothing came by then."""
        return _poll(lambda: self.take(name), deadline)

    def claim(
        self, name: str, lease_s: float, *, lease_if: Callable[[bytes], bool] | None = None
    ) -> Claim | None:
        """Take the record under ``name`` under a lease of ``lease_s`` seconds, or take
        over one whose lease lapsed (see the module docstring); ``None`` at once when
        neither is there (or a racing claimer won). ``lease_if(record)`` false: the
        record needs no lease (all of it is in hand once read); it is taken as by
        ``take`` and ``confirm`` is free."""
        key, lkey = self.key_of(name), self.lease_key_of(name)
        there, leased = self._client.exists_many([key, lkey])
        if there:
            got = self._take_key(key)
            if got is None:
                return None
            expires_ms, record = got
        elif leased:
            held = self._read(lkey)
            if held is None or len(held[1]) < _LEASE.size:
                return None
            until_ms, _ = _LEASE.unpack_from(held[1])
            if until_ms > time.time() * 1000 or self._take_key(lkey) is None:
                return None
            _log.warning("the lease on %r lapsed (its taker died or stalled): taken over", name)
            expires_ms, record = held[0], held[1][_LEASE.size :]
        else:
            return None
        if lease_if is not None and not lease_if(record):
            return Claim(self, name, record, expires_ms, leased=False)
        try:
            token = self._post_lease(name, expires_ms, lease_s, record)
        except BaseException:
            Claim(self, name, record, expires_ms, leased=False).give_back()
            raise
        if token is None:
            self.unleased_claims += 1
            _log.warning(
                "the store pool stayed full for %.1fs: %r is taken without a lease "
                "(a taker dying before it is done loses it)",
                _FULL_LEASE_S,
                name,
            )
            return Claim(self, name, record, expires_ms, leased=False)
        return Claim(self, name, record, expires_ms, leased=True, token=token)

    def _post_lease(
        self, name: str, expires_ms: int, lease_s: float, record: bytes
    ) -> bytes | None:
        """Post ``record`` under ``name``'s lease key with a lease of ``lease_s`` from
        now; its token, or ``None`` when the pool stayed full for ``_FULL_LEASE_S``."""
        token = os.urandom(16)

        def body() -> bytes:
            return _LEASE.pack(int((time.time() + lease_s) * 1000), token) + record

        wrote = self._put_with_room(self.lease_key_of(name), expires_ms, body)
        if wrote is None:
            return None
        if not wrote:
            raise DuplicatePublishError(f"a lease on {name!r} is already there")
        return token

    def _put_with_room(self, key: str, expires_ms: int, body: Callable[[], bytes]) -> bool | None:
        """``_put`` of ``body()`` (built again at each try) retried while the pool is
        full, for up to ``_FULL_LEASE_S``; ``None`` when it stayed full."""
        give_up = time.monotonic() + _FULL_LEASE_S
        delay = 0.001
        while True:
            try:
                return self._put(key, expires_ms, body())
            except StoreFullError:
                left = give_up - time.monotonic()
                if left <= 0:
                    return None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.05)

    def _end_lease(self, name: str, token: bytes) -> bool:
        """Remove ``name``'s lease if it is still the one ``token`` holds; ``False`` when
        it is not (taken over, or discarded), and a taken-over one is put back (retried
        while the pool is full; if it stays full, that taker's confirm says ``False``
        too, and the bytes are left to their expiry)."""
        lkey = self.lease_key_of(name)
        got = self._take_key(lkey)
        if got is None:
            return False
        if got[1][_LEASE.size - 16 : _LEASE.size] != token:  # a takeover's: put it back
            if self._put_with_room(lkey, got[0], lambda: got[1]) is None:
                _log.warning(
                    "the lease of the taker that took %r over could not be put back: "
                    "the store pool stayed full for %.1fs",
                    name,
                    _FULL_LEASE_S,
                )
            return False
        return True

    def claim_until(
        self,
        name: str,
        deadline: float,
        lease_s: float,
        *,
        lease_if: Callable[[bytes], bool] | None = None,
    ) -> Claim | None:
        """``claim`` polled as ``take_until`` polls ``take``."""
        return _poll(lambda: self.claim(name, lease_s, lease_if=lease_if), deadline)

    def take_claimed(self, name: str) -> bytes | None:
        """Remove the record under ``name`` that a claimer holds under a lease (and its
        marker), returning it; ``None`` when there is none. For discarding: the
        claimer's ``confirm`` then says ``False``."""
        got = self._take_key(self.lease_key_of(name))
        return None if got is None else got[1][_LEASE.size :]

    def discard(self, name: str) -> None:
        """Remove ``name``'s record, its lease and their expiry markers (any process)."""
        self.take(name)
        self.take_claimed(name)

    def discard_matching(self, pattern: str) -> int:
        """Remove every record whose name matches the regular expression ``pattern``
        (anchored at the start of the name), their leases and expiry markers; returns
        how many records went."""
        n = 0
        for root in (self.namespace, self.lease_namespace):
            body = re.escape(root) + pattern
            got = self._client.remove_regex("^" + body)
            n += got if root == self.namespace else 0
            self._client.remove_regex("^" + re.escape(TTL_ROOT) + r"\d+/" + body)
        return n

    def discard_prefix(self, prefix: str) -> int:
        """Remove every record whose name starts with ``prefix``; returns how many."""
        return self.discard_matching(re.escape(prefix))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unregister the scratches and close an owned client. Records stay. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for buf in (self._out, self._in):
            try:
                self._client.regs.unpin(describe("mailbox", buf)[1])
            except Exception:  # never pinned (failed construction)
                continue
        if self._own_client:
            self._client.close()

    def __enter__(self) -> Mailbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _poll(attempt: Callable[[], T | None], deadline: float) -> T | None:
    """``attempt()`` with bounded backoff (0.5 ms doubling to 20 ms) until it answers
    or ``deadline`` (``time.monotonic()``) passes."""
    delay = 0.0005
    while (got := attempt()) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.02)
    return got

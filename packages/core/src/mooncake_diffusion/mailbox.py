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

Thread-safe: posts and takes each serialise on their own scratch; a take costs
~0.1 ms when the name is absent and one small read plus a remove when present.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import threading
import time

import numpy as np

from mooncake_diffusion._mooncake.codes import OBJECT_ALREADY_EXISTS
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import DuplicatePublishError, MooncakeError, PayloadError
from mooncake_diffusion.leases import TTL_ROOT, ttl_marker
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.tensors import describe

__all__ = ["DEFAULT_MAX_RECORD", "MAILBOX_ROOT", "Mailbox"]

#: Where records live unless a mailbox is given another namespace.
MAILBOX_ROOT = "mcd-mbox/"
DEFAULT_MAX_RECORD = 1 << 20
_MAX_NAME = 1024
_HEADER = struct.Struct("<Q")  # expires_ms, 0: never
_REPLACE_TRIES = 8


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
        self.max_record = max_record
        self._own_client = client is None
        # records are read with ``read()``, never directly: no second Transfer Engine
        self._client = (
            client
            if client is not None
            else StoreClient(dataclasses.replace(settings, store_direct_reads=False))
        )
        self._out = np.empty(max_record + _HEADER.size, dtype=np.uint8)
        self._in = np.empty(max_record + _HEADER.size, dtype=np.uint8)
        self._out_lock = threading.Lock()
        self._in_lock = threading.Lock()
        self._closed = False
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
        ``replace`` is false (or other posters kept racing on it), and the store's
        errors (``StoreFullError``, ...) otherwise."""
        key = self.key_of(name)
        n = len(record)
        if not 0 < n <= self.max_record:
            raise PayloadError(f"a mailbox record is 1..{self.max_record} bytes, got {n}")
        expires_ms = int(expires_at * 1000) if expires_at is not None else 0
        keys = [key, ttl_marker(expires_ms, key)] if expires_ms else [key]
        replaced = None
        for _ in range(_REPLACE_TRIES):
            # a put of an existing key may report success without writing: check first
            if self._client.exists_many([key])[0]:
                if not replace:
                    break
                old = self.take(name)
                replaced = old if old is not None else replaced
                continue
            with self._out_lock:
                _HEADER.pack_into(self._out, 0, expires_ms)
                self._out[_HEADER.size : _HEADER.size + n] = np.frombuffer(record, np.uint8)
                base = self._out.ctypes.data
                sizes = [[_HEADER.size + n], [1]][: len(keys)]
                try:
                    self._client.put_many(keys, [[base]] * len(keys), sizes, pin="hard")
                except MooncakeError as e:
                    if e.code == OBJECT_ALREADY_EXISTS and replace:
                        continue
                    if e.code == OBJECT_ALREADY_EXISTS:
                        break
                    raise
            return replaced
        raise DuplicatePublishError(f"mailbox name {name!r} already holds a record")

    def peek(self, name: str) -> bytes | None:
        """The record under ``name`` without taking it, or ``None`` at once."""
        got = self._read(name)
        return None if got is None else got[1]

    def _read(self, name: str) -> tuple[int, bytes] | None:
        key = self.key_of(name)
        with self._in_lock:
            n = self._client.read(key, self._in.ctypes.data, len(self._in))
            if n is None:
                return None
            if n < _HEADER.size:
                raise PayloadError(f"mailbox record {name!r} has no header ({n} bytes)")
            (expires_ms,) = _HEADER.unpack_from(self._in, 0)
            return expires_ms, self._in[_HEADER.size : n].tobytes()

    def take(self, name: str) -> bytes | None:
        """Read and remove the record under ``name`` (and its expiry marker); ``None`` at
        once when absent or when a racing taker removed it first (exactly one taker
        gets each record)."""
        got = self._read(name)
        if got is None:
            return None
        expires_ms, record = got
        key = self.key_of(name)
        also = [ttl_marker(expires_ms, key)] if expires_ms else []
        if not self._client.claim(key, also=also):
            return None
        return record

    def take_until(self, name: str, deadline: float) -> bytes | None:
        """``take`` polled with bounded backoff (0.5 ms doubling to 20 ms) until
        ``deadline`` (``time.monotonic()``); ``None`` if nothing came by then."""
        delay = 0.0005
        while (record := self.take(name)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.02)
        return record

    def discard(self, name: str) -> None:
        """Remove ``name``'s record and its expiry marker if there are (any process)."""
        self.take(name)

    def discard_matching(self, pattern: str) -> int:
        """Remove every record whose name matches the regular expression ``pattern``
        (anchored at the start of the name), and their expiry markers; returns how many
        records went."""
        body = re.escape(self.namespace) + pattern
        n = self._client.remove_regex("^" + body)
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

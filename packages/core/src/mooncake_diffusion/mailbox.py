"""A mailbox in Mooncake Store: small records posted and taken by name alone.

Engines whose runtime hands a consumer nothing but a key (vLLM-Omni's
connectors, whose ``put()`` metadata the runtime drops) need the producer to
leave the payload's handle where the consumer can find it from that key. A
mailbox is that place: a record of at most ``max_record`` bytes stored under
``namespace + name``, hard-pinned (never evicted before it is taken).

Call sequence:

    box = Mailbox(settings)                  # connects; fails fast without a master
    box.post(name, record)                   # producer: once per name
    record = box.take(name)                  # consumer: the bytes, or None at once
    record = box.take_until(name, deadline)  # the same, waiting until deadline (monotonic)
    box.discard(name); box.discard_prefix(p) # cleanup from either side
    box.close()

``take`` reads the record in one round trip (no size query: the record lands
in a registered scratch of ``max_record`` bytes) and then claims it by removing
it with force: the master removes an object once, so of any number of takers
racing on one name, in any processes, exactly one gets the record and the
others get ``None`` (as if they had come after). A name is posted
once: ``post`` of a name whose record is still there raises
``DuplicatePublishError`` (checked first: Mooncake's ``put`` of an existing key
neither overwrites nor always fails). Records do not
expire by themselves; whoever gives up on a name discards it.

Thread-safe: posts and takes each serialise on their own scratch; a take costs
~0.1 ms when the name is absent and one small read plus a remove when present.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np

from mooncake_diffusion._mooncake.codes import OBJECT_ALREADY_EXISTS
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import DuplicatePublishError, MooncakeError, PayloadError
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.tensors import describe

__all__ = ["DEFAULT_MAX_RECORD", "MAILBOX_ROOT", "Mailbox"]

#: Where records live unless a mailbox is given another namespace.
MAILBOX_ROOT = "mcd-mbox/"
DEFAULT_MAX_RECORD = 1 << 20
_MAX_NAME = 1024


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
        self._client = client if client is not None else StoreClient(settings)
        self._out = np.empty(max_record, dtype=np.uint8)
        self._in = np.empty(max_record, dtype=np.uint8)
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

    def post(self, name: str, record: bytes | bytearray | memoryview) -> None:
        """Store ``record`` under ``name`` (hard-pinned). Raises ``PayloadError`` when it
        exceeds ``max_record``, ``DuplicatePublishError`` when ``name`` holds a record,
        and the store's errors (``StoreFullError``, ...) otherwise."""
        key = self.key_of(name)
        n = len(record)
        if not 0 < n <= self.max_record:
            raise PayloadError(f"a mailbox record is 1..{self.max_record} bytes, got {n}")
        duplicate = DuplicatePublishError(f"mailbox name {name!r} already holds a record")
        if self._client.exists_many([key])[0]:  # a put of an existing key may report success
            raise duplicate
        with self._out_lock:
            self._out[:n] = np.frombuffer(record, dtype=np.uint8)
            try:
                self._client.put_many([key], [[self._out.ctypes.data]], [[n]], pin="hard")
            except MooncakeError as e:
                if e.code == OBJECT_ALREADY_EXISTS:
                    raise duplicate from None
                raise

    def peek(self, name: str) -> bytes | None:
        """The record under ``name`` without taking it, or ``None`` at once."""
        key = self.key_of(name)
        with self._in_lock:
            n = self._client.read(key, self._in.ctypes.data, self.max_record)
            return None if n is None else self._in[:n].tobytes()

    def take(self, name: str) -> bytes | None:
        """Read and remove the record under ``name``; ``None`` at once when absent or
        when a racing taker removed it first (exactly one taker gets each record)."""
        record = self.peek(name)
        if record is None or not self._client.claim(self.key_of(name)):
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
        """Remove ``name``'s record if there is one (from any process)."""
        self._client.remove_many([self.key_of(name)])

    def discard_matching(self, pattern: str) -> int:
        """Remove every record whose name matches the regular expression ``pattern``
        (anchored at the start of the name); returns how many went."""
        return self._client.remove_regex("^" + re.escape(self.namespace) + pattern)

    def discard_prefix(self, prefix: str) -> int:
        """Remove every record whose name starts with ``prefix``; returns how many."""
        return self._client.remove_prefix(self.namespace + prefix)

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

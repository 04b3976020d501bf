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
    claim = box.claim(name, lease_s)         # consumer with work to do first
    claim.confirm(also=keys)                 # ... delivered (or False: not delivered)
    box.discard(name); box.discard_prefix(p) # cleanup from either side
    box.close()

What happens in the store is ``handoff.protocol``: this class only answers its
operations from Mooncake Store (the tests' explorer answers the same code
from a model of the store, through every interleaving and crash point). The
delivery rule, stated in full there:

- **Exactly once to a reader that confirms within its lease.** Every posting is
  an incarnation with its own random nonce; a record is delivered by the one
  party whose removal of the incarnation's anchor key succeeds (the store
  removes a key once). ``take`` does that at once; ``claim`` first holds a
  lease (a slot key of that incarnation holding the claimer's token), and
  ``Claim.confirm`` commits only while the lease holds: a reader whose lease
  lapsed gets ``False`` (it drops what it fetched) and the record stays for the
  next claim, which takes the lease over by winning the *next* slot, never by
  removing one.
- **Nothing lost.** Until some party commits, the record stays under its name:
  a reader killed at any step before its commit leaves it to the next claim.
- **No orphans.** A post that fails leaves nothing of its own; a replace takes
  only a record whose commit it won; a confirm removes the caller's payload
  keys (``also``) in the commit's own round trip. The one stated window: a
  committer killed between its commit and its cleanup leaves the record (not
  its payload) until its expiry or a ``discard``.

Expiry. A record posted with ``expires_at`` (unix seconds) carries that time,
and beside it expiry markers (``leases.ttl_marker``) for the record and its
anchor: any process listing the store's keys (``leases.Reaper``) removes them
once the time has passed, so records of a producer that crashed are reclaimed
too. Lease slots carry markers at their lapse plus ``protocol.SLOT_GRACE_MS``.
A taker gets the record whether or not it expired (the caller decides).

A full pool. A claim whose lease slot does not fit goes on without a lease
(``unleased_claims`` counts these): it is still delivered at most once (the
commit decides), but another reader may fetch the same bytes meanwhile.

Costs (round trips): a post 2 (put, read back); a take 3 (read the record,
read its first lease slot, commit) plus the record's cleanup (sent after the
caller has gone on with ``async_cleanup``); a claim of a record that needs no
lease 2 plus the cleanup; a leased claim 4 (read, put the slot, read it back,
check the anchor) and its confirm 1 plus the cleanup.
Thread-safe: puts and reads each serialise on their own registered scratch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import MooncakeDiffusionError, PayloadError
from mooncake_diffusion.handoff import protocol
from mooncake_diffusion.handoff.protocol import FULL, OK, Exists, Get, Held, Now, Pause, Put, Remove
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.leases import TTL_ROOT

__all__ = ["DEFAULT_MAX_RECORD", "MAILBOX_ROOT", "Claim", "Mailbox"]

#: Where records live unless a mailbox is given another namespace.
MAILBOX_ROOT = "mcd-mbox/"
DEFAULT_MAX_RECORD = 1 << 20
_MAX_NAME = 1024
_SLACK = 256  # scratch room past a record: its header and the small keys of one put
_POST_TRIES = 64  # a post's attempts while another record stays under its name
_PUT_WAIT_S = 1.0  # how long a read waits for a put in flight under that key
_log = logging.getLogger("mooncake_diffusion.mailbox")
T = TypeVar("T")


class Claim:
    """A record claimed under a lease (``Mailbox.claim``): ``record`` holds its bytes,
    ``expires_at`` its expiry (unix seconds, or ``None``). Call exactly one of
    ``confirm`` or ``give_back`` once the work the record names is done or failed."""

    def __init__(self, box: Mailbox, held: Held) -> None:
        self.name = held.name
        self.record = held.record
        self.expires_at = held.expires_ms / 1000 if held.expires_ms else None
        #: whether a lease holds it (``False``: the record needed none, or the pool
        #: had no room for one)
        self.leased = held.g > 0
        self._box = box
        self._held: Held | None = held

    def confirm(self, also: tuple[str, ...] = ()) -> bool:
        """Commit: the record is delivered to this caller, and the store keys ``also``
        (what the record names) are removed in the same round trip. ``False`` when it
        was not: the lease lapsed (the record stays for the next claim) or another
        party committed it first (a replace or a discard); the caller then drops what
        it fetched and leaves the rest alone."""
        held, self._held = self._held, None
        if held is None:
            raise PayloadError(f"claim on {self.name!r} already ended")
        return bool(self._box._run(protocol.confirm(self._box.keys, held, also)))

    def give_back(self) -> bool:
        """End the lease without committing: the record is claimable again at once.
        ``False`` for a record that needed no lease (it was committed when claimed)."""
        held, self._held = self._held, None
        if held is None:
            return False
        return bool(self._box._run(protocol.give_back(self._box.keys, held)))


class Mailbox:
    """Named records in Mooncake Store (see the module docstring).

    ``client`` may be shared (it is then left open by ``close``); otherwise the
    mailbox makes its own, which probes the master first and raises
    ``MasterUnavailableError`` within ``settings.connect_timeout_s``.
    ``async_cleanup``: see the attribute.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        namespace: str = MAILBOX_ROOT,
        max_record: int = DEFAULT_MAX_RECORD,
        client: StoreClient | None = None,
        async_cleanup: bool = False,
    ) -> None:
        if max_record <= 0:
            raise PayloadError(f"max_record must be positive, got {max_record}")
        self.namespace = namespace
        self.keys = protocol.Keys(namespace)
        #: send a committer's cleanup from a thread of its own after the caller went
        #: on (one round trip off a delivery's path; ``flush`` waits for them)
        self.async_cleanup = async_cleanup
        self.max_record = max_record
        self._own_client = client is None
        # records are read with ``read()``, never directly: no second Transfer Engine
        self._client = (
            client
            if client is not None
            else StoreClient(dataclasses.replace(settings, store_direct_reads=False))
        )
        room = max_record + _SLACK + 2 * _MAX_NAME
        self._out = np.empty(room, dtype=np.uint8)
        self._in = np.empty(room, dtype=np.uint8)
        self._out_lock = threading.Lock()
        self._in_lock = threading.Lock()
        self._closed = False
        #: claims that went on without a lease because the pool was full
        self.unleased_claims = 0
        # cleanups nobody waits for (``Remove(later=True)``), sent by one thread in order
        self._later: deque[tuple[str, ...]] = deque()
        self._later_cv = threading.Condition()
        self._later_thread: threading.Thread | None = None
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
        return self.keys.record(name)

    def post(
        self,
        name: str,
        record: bytes | bytearray | memoryview,
        *,
        expires_at: float | None = None,
        replace: bool = False,
        also_of: Callable[[bytes], tuple[str, ...]] | None = None,
    ) -> bytes | None:
        """Store ``record`` under ``name`` (hard-pinned), expiring at ``expires_at`` (unix
        seconds; see the module docstring) when given. Returns the record it replaced
        (``replace=True``: a record there that no reader holds is committed by this
        post; ``also_of(old)`` names the store keys of what it named, removed in the
        same round trip as the commit) or ``None``. Raises ``PayloadError``
        when it exceeds ``max_record``, ``DuplicatePublishError`` when ``name`` holds a
        record and ``replace`` is false (or a reader kept holding it through every
        attempt), ``StoreFullError`` when the pool has no room; after an error nothing
        of this post is in the store. Returns once the record under ``name`` was read
        back as this one (or was already taken)."""
        self.key_of(name)
        n = len(record)
        if not 0 < n <= self.max_record:
            raise PayloadError(f"a mailbox record is 1..{self.max_record} bytes, got {n}")
        expires_ms = int(expires_at * 1000) if expires_at is not None else 0
        return self._run(
            protocol.post(
                self.keys,
                name,
                bytes(record),
                expires_ms=expires_ms,
                nonce=os.urandom(16),
                replace=replace,
                tries=_POST_TRIES,
                also_of=also_of,
            )
        )

    def peek(self, name: str) -> bytes | None:
        """The record under ``name`` without taking it, or ``None`` at once."""
        got = self._get(self.key_of(name))
        return None if got is None else protocol.unpack_record(got, name)[2]

    def take(
        self, name: str, *, also_of: Callable[[bytes], tuple[str, ...]] | None = None
    ) -> bytes | None:
        """The record under ``name``, delivered to this caller (committed at once), or
        ``None`` at once when absent, held under a reader's live lease, or committed
        first by a racing party. ``also_of(record)``: store keys removed in the
        commit's own round trip (what the record names, when the caller has no more
        use for it)."""
        self.key_of(name)
        return self._run(protocol.take(self.keys, name, also_of=also_of))

    def take_until(self, name: str, deadline: float) -> bytes | None:
        """``take`` polled with bounded backoff (0.5 ms doubling to 20 ms) until
        ``deadline`` (``time.monotonic()``); ``None`` if nothing came by then."""
        return _poll(lambda: self.take(name), deadline)

    def claim(
        self, name: str, lease_s: float, *, lease_if: Callable[[bytes], bool] | None = None
    ) -> Claim | None:
        """Claim the record under ``name`` under a lease of ``lease_s`` seconds (taking
        over a lapsed one), or ``None`` at once when there is none, another reader's
        lease is live, or it was committed meanwhile. ``lease_if(record)`` false: the
        record needs no lease (all of it is in hand once read); it is committed here
        and ``confirm`` is free."""
        self.key_of(name)
        held = self._run(
            protocol.claim(
                self.keys,
                name,
                lease_ms=max(int(lease_s * 1000), 1),
                token=os.urandom(16),
                lease_if=lease_if,
            )
        )
        if held is None:
            return None
        if held.g < 0:
            self.unleased_claims += 1
            _log.warning(
                "the store pool had no room for a lease on %r: claimed without one "
                "(still delivered at most once; another reader may fetch it meanwhile)",
                name,
            )
        return Claim(self, held)

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

    def discard(
        self, name: str, *, also_of: Callable[[bytes], tuple[str, ...]] | None = None
    ) -> bytes | None:
        """Commit whatever is under ``name`` as a discard (from any process), with
        ``also_of(record)`` removed in the same round trip, and return its record;
        ``None`` when there was none. A reader holding it then fails its confirm."""
        self.key_of(name)
        return self._run(protocol.discard(self.keys, name, also_of=also_of))

    def discard_matching(self, pattern: str) -> int:
        """Remove every record whose name matches the regular expression ``pattern``
        (anchored at the start of the name), their anchors, lease slots and expiry
        markers, without the protocol (an operator's sweep); returns how many records
        went."""
        n = 0
        roots = (self.keys.root, self.keys.anchor_root, self.keys.slot_root)
        for root in roots:
            body = re.escape(root) + pattern
            got = self._client.remove_regex("^" + body)
            n += got if root == self.keys.root else 0
            self._client.remove_regex("^" + re.escape(TTL_ROOT) + r"\d+(\.[0-9a-f]+)?/" + body)
        return n

    def discard_prefix(self, prefix: str) -> int:
        """Remove every record whose name starts with ``prefix``; returns how many."""
        return self.discard_matching(re.escape(prefix))

    # ------------------------------------------------------------ the driver
    def _run(self, step: protocol.Step) -> Any:
        """Run one protocol call, answering each operation from the store."""
        if self._closed:
            raise PayloadError("mailbox is closed")
        answer: Any = None
        pause = 0.0005
        while True:
            try:
                op = step.send(answer)
            except StopIteration as done:
                return done.value
            if isinstance(op, Pause):
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
                answer = None
            else:
                answer = self._answer(op)

    def _answer(self, op: protocol.Op) -> Any:
        if isinstance(op, Get):
            return self._get(op.key)
        if isinstance(op, Put):
            return self._put(op.items)
        if isinstance(op, Remove):
            if op.later and self.async_cleanup:
                self._send_later(op.keys)
                return tuple(True for _ in op.keys)
            return tuple(self._client.remove_each(op.keys))
        if isinstance(op, Exists):
            return tuple(self._client.exists_many(op.keys))
        if isinstance(op, Now):
            return int(time.time() * 1000)
        raise TypeError(f"not a store operation: {op!r}")

    def _get(self, key: str) -> bytes | None:
        with self._in_lock:
            ready_by = time.monotonic() + _PUT_WAIT_S
            n = self._client.read(key, self._in.ctypes.data, len(self._in), ready_by=ready_by)
            return None if n is None else self._in[:n].tobytes()

    def _put(self, items: tuple[tuple[str, bytes], ...]) -> tuple[int, ...]:
        with self._out_lock:
            base = self._out.ctypes.data
            ptrs, sizes, at = [], [], 0
            for _, body in items:
                n = len(body)
                if at + n > len(self._out):
                    raise PayloadError(f"a mailbox put of {at + n} bytes exceeds its scratch")
                self._out[at : at + n] = np.frombuffer(body, np.uint8)
                ptrs.append([base + at])
                sizes.append([n])
                at += -(-n // 64) * 64
            took = self._client.put_each([k for k, _ in items], ptrs, sizes, pin="hard")
        return tuple(OK if ok else FULL for ok in took)

    def _send_later(self, keys: tuple[str, ...]) -> None:
        with self._later_cv:
            self._later.append(keys)
            if self._later_thread is None:
                self._later_thread = threading.Thread(
                    target=self._cleaner, name="mailbox-cleanup", daemon=True
                )
                self._later_thread.start()
            self._later_cv.notify()

    def _cleaner(self) -> None:
        """Send queued cleanups in order until ``close`` (which waits for the queue)."""
        while True:
            with self._later_cv:
                while not self._later and not self._closed:
                    self._later_cv.wait()
                if not self._later:
                    return
                keys = self._later[0]
            try:
                self._client.remove_many(keys)
            except MooncakeDiffusionError as e:  # left to their expiry markers / discard
                _log.warning("mailbox cleanup of %d keys failed: %s", len(keys), e)
            with self._later_cv:
                self._later.popleft()
                self._later_cv.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued cleanup was sent; ``False`` on timeout."""
        end = time.monotonic() + timeout_s
        with self._later_cv:
            while self._later:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._later_cv.wait(left)
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Send the queued cleanups, unregister the scratches and close an owned
        client. Records stay. Idempotent."""
        if self._closed:
            return
        self.flush()
        with self._later_cv:
            self._closed = True
            self._later_cv.notify_all()
            thread = self._later_thread
        if thread is not None:
            thread.join(timeout=10.0)
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

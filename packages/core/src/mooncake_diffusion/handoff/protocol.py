"""The mailbox's delivery protocol, written once and without I/O.

Every step that touches the store is a ``yield`` of one operation (``Put``,
``Get``, ``Exists``, ``Remove``, ``Now``, ``Pause``) answered by a driver:
``Mailbox`` answers them from Mooncake Store, the tests' explorer from
``handoff.model.ModelStore`` (the same operations with Mooncake's semantics),
one operation at a time, in every order, with a crash possible before each.
So the code that is model-checked is the code that runs.

The store's contract (Mooncake's, checked against the real master in the
integration tests):

- ``Put`` stores each key in order; a key that exists is left as it is and
  the answer is still ``OK`` (Mooncake's put never overwrites and may not
  say so); ``FULL`` when the pool has no room for that key.
- ``Remove`` removes each key in order and answers, per key, whether this
  call removed it: of any number of removers of one key exactly one gets
  ``True``. Other parties' operations may land between two keys of one batch.
- ``Get`` reads a key's bytes or ``None``; ``Exists`` says which keys are there.
- There is no compare-and-set and no conditional remove.

Keys of one name ``n`` (see ``Keys``):

- ``R``, the record: ``[expires_ms u64][nonce 16 bytes][record]``; ``nonce``
  is the posting call's own random value, so each posting is an *incarnation*.
- ``A(x)``, the incarnation's anchor: one byte, put with ``R`` in the same
  operation. **Removing ``A(x)`` is the commit of incarnation ``x``**: the one
  party whose ``Remove`` of it answers ``True`` (a reader delivering it, a
  replacing producer, a discard) owns ``x``'s end; every other party's claim
  on ``x`` fails. ``A(x)`` is named by ``x``, so no later posting under ``n``
  can be mistaken for it (no ABA).
- ``F(x, g)``, lease slots ``g = 1, 2, ...``: ``[until_ms u64][token 16]``. A
  reader that needs time (a payload to fetch before it may commit) creates
  the lowest slot that is free or whose lease lapsed, with its own token, and
  holds the lease if reading the slot back shows its token. A lapsed lease is
  taken over by creating the *next* slot, never by removing the lapsed one,
  so a takeover can only win a slot nobody holds. Leases keep a second
  reader from fetching while the first is alive; delivery never rests on
  them (the commit does). Each slot carries an expiry marker at
  ``until + SLOT_GRACE_MS``, so a slot whose holder died is reaped.

The delivery rule:

1. A record is delivered at most once: a reader returns it only after its
   commit answered ``True``.
2. A reader whose lease lapsed does not commit (``confirm`` answers ``False``
   and the caller drops what it fetched); the record stays for the next
   claim, which takes the lease over.
3. Nothing is lost: until some party commits ``x``, ``R`` holds ``x`` and a
   claim can take it (a reader dying at any step before its commit leaves
   the record to the next one, after its lease lapses).
4. A post that fails (``DuplicatePublishError``, ``StoreFullError``) leaves
   nothing of its own in the store and its record is never delivered; a
   replace takes only a record whose commit it won.
5. Nothing is left behind: each party removes the keys it made when it loses,
   the winner of a commit removes ``R``, its marker and the slots it knows
   of, and the caller's ``also`` keys (a payload's store objects) go in the
   commit's own operation, so no crash point strands a payload. One window
   remains, stated here because the store offers no conditional remove: a
   committer that dies between its commit and its cleanup leaves ``R`` (the
   record only, never its payload) until ``R``'s expiry marker or a
   ``discard``; only the committer may remove ``R`` (any other remover could
   remove a later incarnation).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from mooncake_diffusion.errors import DuplicatePublishError, PayloadError, StoreFullError
from mooncake_diffusion.transfer.leases import ttl_marker

__all__ = [
    "FULL",
    "OK",
    "SLOT_GRACE_MS",
    "Exists",
    "Get",
    "Held",
    "Keys",
    "Now",
    "Pause",
    "Put",
    "Remove",
    "claim",
    "confirm",
    "discard",
    "give_back",
    "post",
    "take",
]

OK = 0
FULL = 1
#: how long after its lease lapsed a slot's marker lets a reaper remove the slot
SLOT_GRACE_MS = 60_000
MAX_SLOTS = 64  # takeovers of one record before a claim gives up on it
_RECORD = struct.Struct("<Q16s")  # expires_ms (0: never), nonce
_SLOT = struct.Struct("<Q16s")  # until_ms, token


@dataclass(frozen=True, slots=True)
class Put:
    """Store each ``(key, bytes)`` (see the contract); answers a code per key."""

    items: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class Get:
    """Read ``key``; answers its bytes or ``None``."""

    key: str


@dataclass(frozen=True, slots=True)
class Exists:
    """Answers, per key, whether it is there."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Remove:
    """Remove each key; answers, per key, whether this operation removed it.
    ``later``: nobody waits for the answer (a committer's cleanup): a driver may
    send it after the caller has gone on (the explorer runs it at any later
    point, or never when its party crashes first)."""

    keys: tuple[str, ...]
    later: bool = False


@dataclass(frozen=True, slots=True)
class Now:
    """Answers the time (unix ms)."""


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait a little before trying again (a driver sleeps; the explorer yields)."""


Op = Put | Get | Exists | Remove | Now | Pause
Step = Generator[Op, Any, Any]


@dataclass(frozen=True, slots=True)
class Keys:
    """Where a mailbox's keys live: ``root`` the records, and beside it the
    anchors and the lease slots."""

    root: str

    @property
    def anchor_root(self) -> str:
        return self.root.rstrip("/") + "-anchor/"

    @property
    def slot_root(self) -> str:
        return self.root.rstrip("/") + "-lease/"

    def record(self, name: str) -> str:
        return self.root + name

    def anchor(self, name: str, nonce: bytes) -> str:
        return f"{self.anchor_root}{name}/{nonce.hex()}"

    def slot(self, name: str, nonce: bytes, g: int) -> str:
        return f"{self.slot_root}{name}/{nonce.hex()}/{g}"


@dataclass(frozen=True, slots=True)
class Held:
    """A record claimed under lease slot ``g`` (``g == 0``: committed already, it
    needed no lease; ``g == -1``: no lease, the pool had no room for one).
    ``slots``: ``(g, until_ms, token)`` of every slot this claimer saw, its own
    last."""

    name: str
    nonce: bytes
    record: bytes
    expires_ms: int
    g: int = 0
    until_ms: int = 0
    slots: tuple[tuple[int, int, bytes], ...] = ()


Slots = tuple[tuple[int, int, bytes], ...]


def pack_record(expires_ms: int, nonce: bytes, record: bytes) -> bytes:
    return _RECORD.pack(expires_ms, nonce) + record


def unpack_record(raw: bytes, key: str) -> tuple[int, bytes, bytes]:
    """``(expires_ms, nonce, record)`` of a stored record."""
    if len(raw) < _RECORD.size:
        raise PayloadError(f"mailbox record {key!r} has no header ({len(raw)} bytes)")
    expires_ms, nonce = _RECORD.unpack_from(raw)
    return expires_ms, nonce, raw[_RECORD.size :]


def _markers(keys: Keys, name: str, nonce: bytes, expires_ms: int) -> list[str]:
    """The expiry markers of incarnation ``nonce``'s record and anchor (its own,
    tagged with the nonce: another incarnation's with the same expiry differ)."""
    if not expires_ms:
        return []
    tag = nonce.hex()
    return [
        ttl_marker(expires_ms, keys.record(name), tag),
        ttl_marker(expires_ms, keys.anchor(name, nonce), tag),
    ]


def slot_marker(keys: Keys, name: str, nonce: bytes, g: int, until: int, token: bytes) -> str:
    """The expiry marker of slot ``g`` as its holder ``token`` put it."""
    return ttl_marker(until + SLOT_GRACE_MS, keys.slot(name, nonce, g), token.hex())


def slot_keys(keys: Keys, name: str, nonce: bytes, slots: Slots) -> list[str]:
    """The keys of ``slots`` (``(g, until_ms, token)``) and of their expiry markers."""
    out = []
    for g, until, token in slots:
        out += [keys.slot(name, nonce, g), slot_marker(keys, name, nonce, g, until, token)]
    return out


# ------------------------------------------------------------------ producer
def post(
    keys: Keys,
    name: str,
    record: bytes,
    *,
    expires_ms: int,
    nonce: bytes,
    replace: bool,
    tries: int,
    also_of: Callable[[bytes], tuple[str, ...]] | None = None,
) -> Step:
    """Post ``record`` under ``name``; returns the record it replaced (``replace``)
    or ``None``. ``also_of(old)``: the store keys a replaced record names (its
    payload), removed in the replace's commit. Raises ``DuplicatePublishError``
    (another record is there and ``replace`` is false, or it stayed there through
    ``tries`` attempts) and ``StoreFullError``; either way nothing of this post is
    left."""
    r = keys.record(name)
    a = keys.anchor(name, nonce)
    # markers first: no key of ours lands without one, whoever crashes
    own = [(m, b"\x01") for m in _markers(keys, name, nonce, expires_ms)]
    own += [(a, b"\x01"), (r, pack_record(expires_ms, nonce, record))]
    replaced = None
    wait = False
    for _ in range(tries):
        if wait:
            yield Pause()
        wait = True
        codes = yield Put(tuple(own))
        if FULL in codes:
            there = yield Get(r)
            if there is not None and unpack_record(there, r)[1] == nonce:
                # ours without its anchor: inert (no commit can win it), ours to remove
                yield Remove((r,))
            yield from _withdraw(keys, name, nonce, expires_ms)
            raise StoreFullError(f"the store pool is full: mailbox name {name!r} not posted")
        there = yield Get(r)
        if there is None:
            (ours_unsettled,) = yield Exists((a,))
            if not ours_unsettled:
                return replaced  # ours landed and a reader already took it
            wait = False
            continue  # ours never landed and the other one went meanwhile: again
        other_expires, other, old = unpack_record(there, r)
        if other == nonce:
            return replaced
        (ours_unsettled,) = yield Exists((a,))
        if not ours_unsettled:
            # ours landed and ended (taken, or replaced by another post) before that
            # one landed: posted; never post it again (it could be delivered twice)
            return replaced
        if not replace:
            yield from _withdraw(keys, name, nonce, expires_ms)
            raise DuplicatePublishError(f"mailbox name {name!r} already holds a record")
        live, slots = yield from _slots(keys, name, other)
        if live:
            continue  # a reader is fetching it: it goes soon, or its lease lapses
        also = also_of(old) if also_of is not None else ()
        # the cleanup awaited: this post needs the name free next
        won = yield from _commit(keys, name, other, other_expires, slots=slots, also=also, now=True)
        if won:
            replaced = old
            wait = False
    yield from _withdraw(keys, name, nonce, expires_ms)
    raise DuplicatePublishError(
        f"mailbox name {name!r}: another record stayed there through {tries} attempts"
    )


def _withdraw(keys: Keys, name: str, nonce: bytes, expires_ms: int) -> Step:
    """Remove what a post that did not land left: its anchor and its markers."""
    yield Remove((keys.anchor(name, nonce), *_markers(keys, name, nonce, expires_ms)))


def _slots(keys: Keys, name: str, nonce: bytes) -> Step:
    """``(live, slots)``: whether a lease on incarnation ``nonce`` is live now, and
    ``(g, until_ms, token)`` of the slots read (up to the live one, or all)."""
    now = yield Now()
    seen: list[tuple[int, int, bytes]] = []
    for g in range(1, MAX_SLOTS + 1):
        raw = yield Get(keys.slot(name, nonce, g))
        if raw is None:
            break
        until_ms, holder = _SLOT.unpack_from(raw)
        seen.append((g, until_ms, holder))
        if until_ms > now:
            return True, tuple(seen)
    return False, tuple(seen)


# ------------------------------------------------------------------ consumer
def take(
    keys: Keys,
    name: str,
    *,
    force: bool = False,
    also_of: Callable[[bytes], tuple[str, ...]] | None = None,
) -> Step:
    """The record under ``name``, committed at once, or ``None`` (none there, a
    reader's lease on it is live, or another party committed it first).
    ``force``: commit it over a live lease too (a discard). ``also_of(record)``:
    store keys removed in the commit's own operation (what the record names)."""
    r = keys.record(name)
    got = yield Get(r)
    if got is None:
        return None
    expires_ms, nonce, record = unpack_record(got, r)
    live, slots = yield from _slots(keys, name, nonce)
    if live and not force:
        return None
    also = also_of(record) if also_of is not None else ()
    if (yield from _commit(keys, name, nonce, expires_ms, slots=slots, also=also)):
        return record
    return None


def claim(
    keys: Keys,
    name: str,
    *,
    lease_ms: int,
    token: bytes,
    lease_if: Callable[[bytes], bool] | None = None,
) -> Step:
    """Claim the record under ``name``: a ``Held`` (leased unless ``lease_if(record)``
    is false or the pool had no room for a lease), or ``None`` when there is none,
    another reader's lease on it is live, or it was committed meanwhile. A record
    that needs no lease is committed here (its ``Held`` has ``g == 0`` and
    ``confirm`` answers ``True`` at no cost)."""
    r = keys.record(name)
    got = yield Get(r)
    if got is None:
        return None
    expires_ms, nonce, record = unpack_record(got, r)
    if lease_if is not None and not lease_if(record):
        if (yield from _commit(keys, name, nonce, expires_ms, slots=())):
            return Held(name, nonce, record, expires_ms)
        return None
    seen: list[tuple[int, int, bytes]] = []
    for g in range(1, MAX_SLOTS + 1):
        now = yield Now()
        until = now + lease_ms
        slot = keys.slot(name, nonce, g)
        marker = slot_marker(keys, name, nonce, g, until, token)
        # the marker first: a slot never lands without one, whoever crashes
        codes = yield Put(((marker, b"\x01"), (slot, _SLOT.pack(until, token))))
        if FULL in codes:
            # no room for a lease: go on without one (the commit still decides)
            drop = [marker] if codes[0] == OK else []
            if codes[1] == OK:  # another's already there, or ours once room came
                mine = yield Get(slot)
                if mine is not None and _SLOT.unpack_from(mine)[1] == token:
                    drop.append(slot)
            if drop:
                yield Remove(tuple(drop))
            return Held(name, nonce, record, expires_ms, g=-1, slots=tuple(seen))
        there = yield Get(slot)
        if there is None:  # the slots went with a commit: the record is gone
            yield Remove((marker,))
            return None
        held_until, holder = _SLOT.unpack_from(there)
        if holder == token:
            seen.append((g, until, token))
            (open_,) = yield Exists((keys.anchor(name, nonce),))
            if not open_:  # won a slot of a record already committed
                yield Remove((slot, marker))
                return None
            return Held(name, nonce, record, expires_ms, g, until, tuple(seen))
        yield Remove((marker,))  # ours, beside a slot that is another's
        seen.append((g, held_until, holder))
        now = yield Now()
        if held_until > now:
            return None  # a live lease: another reader is fetching it
    return None


def confirm(keys: Keys, held: Held, also: tuple[str, ...] = ()) -> Step:
    """Commit ``held``: ``True`` when this reader delivers it (and ``also``, the
    store keys of what the record names, were removed in the commit's own
    operation); ``False`` when its lease lapsed (nothing removed: the record
    stays for the next claim) or another party committed it first."""
    if held.g == 0:
        if also:
            yield Remove(also)
        return True
    own = slot_keys(keys, held.name, held.nonce, held.slots[-1:]) if held.g > 0 else []
    if own and (yield Now()) >= held.until_ms:
        yield Remove(tuple(own))
        return False
    won = yield from _commit(
        keys, held.name, held.nonce, held.expires_ms, slots=held.slots, also=also
    )
    if not won and own:
        yield Remove(tuple(own))
    return won


def give_back(keys: Keys, held: Held) -> Step:
    """End ``held``'s lease without committing: the record is claimable again at
    once. ``False`` for a record that needed no lease (it was committed when
    claimed; the caller still holds it)."""
    if held.g > 0:
        yield Remove(tuple(slot_keys(keys, held.name, held.nonce, held.slots[-1:])))
    return held.g != 0


def discard(
    keys: Keys, name: str, *, also_of: Callable[[bytes], tuple[str, ...]] | None = None
) -> Step:
    """Commit whatever is under ``name`` as a discard, over a live lease too;
    returns its record (``also_of(record)`` removed with the commit) or ``None``.
    A reader holding it then fails its confirm."""
    return (yield from take(keys, name, force=True, also_of=also_of))


def _commit(
    keys: Keys,
    name: str,
    nonce: bytes,
    expires_ms: int,
    *,
    slots: Slots,
    also: tuple[str, ...] = (),
    now: bool = False,
) -> Step:
    """Remove incarnation ``nonce``'s anchor (and ``also`` in the same operation);
    when this call removed it, remove the record, the markers and the ``slots``
    (``(g, until_ms, token)``) with theirs, unawaited unless ``now``. Returns whether this
    call committed."""
    a = keys.anchor(name, nonce)
    won = yield Remove((a, *also))
    if not won[0]:
        return False
    drop = [keys.record(name), *_markers(keys, name, nonce, expires_ms)]
    drop += slot_keys(keys, name, nonce, slots)
    yield Remove(tuple(drop), later=not now)
    return True

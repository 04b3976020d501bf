"""The mailbox protocol as it was before the delivery rule (release 0.1.0 up to
the change that added ``handoff.protocol``), transcribed operation for
operation into the same yield-an-operation form, so the explorer can show
the three windows it had:

- a takeover that removes whatever lease is there now (a fresh one too);
- the round trip between the take of the record and the post of its lease;
- a replacing post that took a record, lost to another post and never gave
  back or freed what it took.

Test material only: nothing in the package runs it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from mooncake_diffusion.errors import DuplicatePublishError
from mooncake_diffusion.handoff.protocol import FULL, Exists, Get, Now, Put, Remove, Step
from mooncake_diffusion.transfer.leases import ttl_marker

_HEADER = struct.Struct("<Q")
_LEASE = struct.Struct("<Q16s")
ROOT = "v1-mbox/"
LEASE_ROOT = "v1-mbox-lease/"


@dataclass(frozen=True)
class V1Held:
    name: str
    record: bytes
    token: bytes
    leased: bool


def _take_key(key: str) -> Step:
    got = yield Get(key)
    if got is None:
        return None
    (expires_ms,) = _HEADER.unpack_from(got)
    also = (ttl_marker(expires_ms, key),) if expires_ms else ()
    won = yield Remove((key, *also))
    return got if won[0] else None


def post(name: str, record: bytes, *, expires_ms: int, replace: bool, tries: int = 8) -> Step:
    key = ROOT + name
    mine = _HEADER.pack(expires_ms) + record
    replaced = None
    for _ in range(tries):
        (there,) = yield Exists((key,))
        if there:
            if not replace:
                break
            old = yield from _take_key(key)
            replaced = old[_HEADER.size :] if old is not None else replaced
            continue
        items = (
            ((key, mine), (ttl_marker(expires_ms, key), b"\x01")) if expires_ms else ((key, mine),)
        )
        yield Put(items)
        back = yield Get(key)
        if back is None or back == mine:
            return replaced
        if expires_ms and _HEADER.unpack_from(back)[0] != expires_ms:
            yield Remove((ttl_marker(expires_ms, key),))
        raise DuplicatePublishError(f"{name!r}: another record was posted at the same time")
    raise DuplicatePublishError(f"{name!r} already holds a record")


def claim(name: str, *, lease_ms: int, token: bytes) -> Step:
    key, lkey = ROOT + name, LEASE_ROOT + name
    there, leased = yield Exists((key, lkey))
    if there:
        got = yield from _take_key(key)
        if got is None:
            return None
        record = got[_HEADER.size :]
        expires_ms = _HEADER.unpack_from(got)[0]
    elif leased:
        held = yield Get(lkey)
        if held is None:
            return None
        until, _ = _LEASE.unpack_from(held, _HEADER.size)
        now = yield Now()
        if until > now:
            return None
        got = yield from _take_key(lkey)
        if got is None:
            return None
        record = held[_HEADER.size + _LEASE.size :]
        expires_ms = _HEADER.unpack_from(held)[0]
    else:
        return None
    now = yield Now()
    body = _HEADER.pack(expires_ms) + _LEASE.pack(now + lease_ms, token) + record
    codes = yield Put(((lkey, body),))
    if codes[0] == FULL:
        return V1Held(name, record, token, leased=False)
    return V1Held(name, record, token, leased=True)


def confirm(held: V1Held, also: tuple[str, ...]) -> Step:
    if held.leased:
        lkey = LEASE_ROOT + held.name
        got = yield from _take_key(lkey)
        if got is None:
            return False
        if got[_HEADER.size + 8 : _HEADER.size + _LEASE.size] != held.token:
            yield Put(((lkey, got),))  # a takeover's: put it back
            return False
    yield Remove(also)  # the consumer then drops the payload
    return True

"""The mailbox's delivery rule, model-checked: every interleaving and crash point
of producers, readers and a clock, against ``handoff.model.ModelStore``.

The protocol code explored is ``handoff.protocol``, the code ``Mailbox`` runs
against Mooncake Store; ``handoff_v1`` is the protocol it replaced, explored by
the same checks to show the three windows it had (each test names one). State
counts are printed (``-s``) and asserted non-trivial, so a scenario that stopped
exploring would fail rather than pass empty.
"""

from __future__ import annotations

import handoff_v1 as v1
import pytest
from protocol_explorer import Explorer, Held_, Party, Phase, _drive, clock

from mooncake_diffusion.errors import DuplicatePublishError, StoreFullError
from mooncake_diffusion.handoff import protocol
from mooncake_diffusion.handoff.model import ModelStore
from mooncake_diffusion.handoff.protocol import Keys, Pause, Put, Remove

pytestmark = pytest.mark.unit

KEYS = Keys("mbox/")
NAME = "req"
LEASE_MS = 1_000
EXPIRES_MS = 10**9 * 4  # far off: nothing expires until the final sweep


def payload_key(record: bytes) -> str:
    return "mcd/" + record.decode()


def also_of(record: bytes) -> tuple[str, ...]:
    return (payload_key(record),)


def _nonce(i: int) -> bytes:
    return bytes([i]) * 16


# ------------------------------------------------------------------ parties
def producer(i: int, *, replace: bool = True, expires: bool = True) -> Party:
    record = f"rec{i}".encode()

    def make():
        try:
            old = yield from protocol.post(
                KEYS,
                NAME,
                record,
                expires_ms=EXPIRES_MS if expires else 0,
                nonce=_nonce(i),
                replace=replace,
                tries=3,
                also_of=also_of,
            )
        except (DuplicatePublishError, StoreFullError):
            yield Remove((payload_key(record),))  # the sender releases its payload
            raise
        return old

    return Party(f"P{i}", "producer", make, record)


def reader(i: int, *, give_back: bool = False) -> Party:
    def make():
        held = yield from protocol.claim(KEYS, NAME, lease_ms=LEASE_MS, token=_nonce(100 + i))
        if held is None:
            return None
        yield Held_(held.record)
        yield Pause()  # the payload's transfer
        if give_back:
            yield from protocol.give_back(KEYS, held)
            return None
        yield Phase("confirm")
        ok = yield from protocol.confirm(KEYS, held, also_of(held.record))
        return held.record if ok else None

    return Party(f"R{i}", "reader", make)


def taker(i: int) -> Party:
    def make():
        yield Phase("confirm")  # its commit is its delivery point
        return (yield from protocol.take(KEYS, NAME, also_of=also_of))

    return Party(f"T{i}", "taker", make)


def recover(name: str):
    held = yield from protocol.claim(KEYS, name, lease_ms=LEASE_MS, token=_nonce(250))
    if held is None:
        return None
    ok = yield from protocol.confirm(KEYS, held, also_of(held.record))
    return held.record if ok else None


def publish(store: ModelStore, records: list[bytes], *, expires: bool = True) -> None:
    """What the producers published before posting: their payloads' store keys."""
    for rec in records:  # (a payload's key carries its expiry in its name: no marker)
        store.apply(Put(((payload_key(rec), b"p"),)))


def stated_leftovers(key: str, lives) -> bool:
    """What the delivery rule allows to stay after the final sweep (see
    ``protocol``): a crashed producer's own keys (with no expiry), and the record of
    a committer that crashed between its commit and its cleanup."""
    crashed_producers = [lv for lv in lives if lv.crashed and lv.party.kind == "producer"]
    for lv in crashed_producers:
        i = int(lv.party.name[1:])
        if key in (payload_key(lv.party.record), KEYS.anchor(NAME, _nonce(i))):
            return True
    crashed_committer = any(
        lv.crashed and any(k.startswith(KEYS.anchor_root) for k in lv.removed) for lv in lives
    )
    return crashed_committer and key == KEYS.record(NAME)


def ended_elsewhere(record: bytes, lives) -> bool:
    """A record no live party returned may be missing only if the party that
    committed it (removed its anchor) crashed afterwards (delivered to a reader that
    died), or was a producer replacing it whose own post then lost to a third one
    (the newest record stands)."""
    anchor = KEYS.anchor(NAME, _nonce(int(record.decode()[3:])))
    return any(anchor in lv.removed and (lv.crashed or lv.party.kind == "producer") for lv in lives)


def readers_committed_what_they_returned(lives) -> list[str]:
    """Each record a reader or taker returned is one whose anchor it removed itself."""
    return [
        f"{lv.party.name} returned {lv.result!r} without committing it"
        for lv in lives
        if lv.party.kind in ("reader", "taker")
        and isinstance(lv.result, bytes)
        and KEYS.anchor(NAME, _nonce(int(lv.result.decode()[3:]))) not in lv.removed
    ]


def explore(
    parties, *, posted=(), expires=True, capacity=None, crashes=1, split=True, dead_reader=False
):
    records = [p.record for p in parties if p.kind == "producer"] + [r for _, r in posted]

    def setup(store: ModelStore) -> None:
        publish(store, records, expires=expires)
        for i, rec in posted:
            _drive(
                store,
                protocol.post(
                    KEYS,
                    NAME,
                    rec,
                    expires_ms=EXPIRES_MS if expires else 0,
                    nonce=_nonce(i),
                    replace=False,
                    tries=1,
                ),
            )
        if dead_reader:  # a reader claimed it and died holding the lease
            _drive(store, protocol.claim(KEYS, NAME, lease_ms=LEASE_MS, token=_nonce(99)))

    ex = Explorer(
        parties,
        setup=setup,
        excused=ended_elsewhere,
        recover=recover,
        names=[NAME],
        crashes=crashes,
        split=split,
        capacity=capacity,
        allowed_left=stated_leftovers,
        strict=not dead_reader,
        check=readers_committed_what_they_returned,
    )
    ex.expected = [r for _, r in posted]
    return ex.run()


# ------------------------------------------------------------------ the rule holds
def test_two_producers_replacing_and_two_readers_with_a_crash_anywhere(capsys):
    # batches whole here (four parties); the three-party scenarios split them
    report = explore([producer(1), producer(2), reader(1), reader(2)], split=False)
    _show(capsys, "P1 P2 R1 R2", report)
    assert report.states > 50_000 and report.violations == {}


def test_lapsed_leases_taken_over_by_racing_readers_deliver_once(capsys):
    # a reader died holding the lease; three more race while the clock jumps past it
    parties = [reader(1), reader(2), reader(3), Party("clock", "clock", _past_leases)]
    report = explore(parties, posted=[(9, b"rec9")], dead_reader=True)
    _show(capsys, "dead R0, R1 R2 R3 clock", report)
    assert report.states > 10_000 and report.violations == {}


def test_a_reader_giving_back_a_taker_a_replacing_producer_and_a_reader(capsys):
    parties = [reader(1, give_back=True), taker(1), producer(2), reader(2)]
    report = explore(parties, posted=[(9, b"rec9")], split=False)
    _show(capsys, "R1(give back) T1 P2 R2", report)
    assert report.states > 50_000 and report.violations == {}


def test_producers_racing_a_reader_while_leases_lapse(capsys):
    parties = [producer(1), producer(2), reader(1), Party("clock", "clock", _past_leases)]
    report = explore(parties)
    _show(capsys, "P1 P2 R1 clock", report)
    assert report.states > 5_000 and report.violations == {}


def test_posts_without_replace_and_without_expiry_leave_only_what_the_rule_states(capsys):
    parties = [producer(1, replace=False, expires=False), producer(2, replace=False, expires=False)]
    parties.append(reader(1))
    report = explore(parties, expires=False)
    _show(capsys, "P1 P2 (no replace, no expiry) R1", report)
    assert report.states > 500 and report.violations == {}


def test_a_full_pool_claims_without_a_lease_and_still_delivers_once(capsys):
    # room for the posted record, its anchor, their markers and the payload: no slot
    report = explore([reader(1), reader(2)], posted=[(9, b"rec9")], capacity=6)
    _show(capsys, "R1 R2 (full pool)", report)
    assert report.states > 200 and report.violations == {}


def _past_leases():
    return clock(LEASE_MS + 1)


def _show(capsys, what: str, report) -> None:
    with capsys.disabled():
        print(
            f"\n  explorer {what}: {report.states} states, {report.ends} end states, "
            f"violations {sorted(report.violations) or 'none'}"
        )


# ------------------------------------------------------------------ the old protocol's windows
def v1_reader(i: int) -> Party:
    """What the old ``KeyedHandoff.receive`` did: a confirm that answered ``False``
    was logged ("delivered more than once") and the object returned all the same."""

    def make():
        held = yield from v1.claim(NAME, lease_ms=LEASE_MS, token=_nonce(100 + i))
        if held is None:
            return None
        yield Held_(held.record)
        yield Pause()
        yield Phase("confirm")
        yield from v1.confirm(held, also_of(held.record))
        return held.record

    return Party(f"R{i}", "reader", make)


def v1_producer(i: int) -> Party:
    record = f"rec{i}".encode()

    def make():
        try:
            old = yield from v1.post(NAME, record, expires_ms=0, replace=True, tries=3)
        except DuplicatePublishError:
            yield Remove((payload_key(record),))
            raise
        if old is not None:
            yield Remove(also_of(old))
        return old

    return Party(f"P{i}", "producer", make, record)


def v1_recover(name: str):
    held = yield from v1.claim(name, lease_ms=LEASE_MS, token=_nonce(250))
    if held is None:
        return None
    ok = yield from v1.confirm(held, also_of(held.record))
    return held.record if ok else None


def v1_explore(parties, *, posted=(), crashes=1, dead_reader=False):
    records = [p.record for p in parties if p.kind == "producer"] + [r for r in posted]

    def setup(store: ModelStore) -> None:
        publish(store, records, expires=False)
        for rec in posted:
            _drive(store, v1.post(NAME, rec, expires_ms=0, replace=False))
        if dead_reader:  # a reader claimed it and died holding the lease
            _drive(store, v1.claim(NAME, lease_ms=LEASE_MS, token=_nonce(99)))

    def leftovers(key: str, lives) -> bool:
        return any(
            lv.crashed and lv.party.kind == "producer" and key == payload_key(lv.party.record)
            for lv in lives
        )

    def held_by_the_dead(record: bytes, lives) -> bool:
        return any(lv.crashed and lv.crashed_in == "confirm" and lv.held == record for lv in lives)

    ex = Explorer(
        parties,
        setup=setup,
        excused=held_by_the_dead,
        recover=v1_recover,
        names=[NAME],
        crashes=crashes,
        allowed_left=leftovers,
        strict=not dead_reader,
    )
    ex.expected = list(posted)
    return ex.run()


def test_the_old_takeover_removed_a_fresh_lease_and_delivered_twice(capsys):
    # a reader died holding the lease; once it lapsed, two readers race to take it over
    parties = [v1_reader(2), v1_reader(3), Party("clock", "clock", lambda: clock(LEASE_MS + 1))]
    report = v1_explore(parties, posted=[b"rec9"], crashes=0, dead_reader=True)
    _show(capsys, "old protocol: dead R0, R2 R3 clock", report)
    assert "twice" in report.violations


def test_the_old_take_to_lease_window_lost_the_record_of_a_reader_killed_there(capsys):
    report = v1_explore([v1_reader(1)], posted=[b"rec9"], crashes=1)
    _show(capsys, "old protocol: R1 killed anywhere", report)
    assert "lost" in report.violations


def test_the_old_losing_replace_orphaned_the_record_it_took(capsys):
    report = v1_explore([v1_producer(2), v1_producer(3)], posted=[b"rec1"], crashes=0)
    _show(capsys, "old protocol: P2 P3 replacing", report)
    assert "orphan" in report.violations and "lost" in report.violations

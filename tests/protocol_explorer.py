"""An explorer of every interleaving and crash point of the mailbox protocol.

Parties (producers posting, readers claiming and confirming, takers, a
clock that may jump past every lease) are generators that yield store
operations (``handoff.protocol``'s). The explorer answers them from
``handoff.model.ModelStore`` one operation at a time and, depth first, tries
every order in which the parties' next operations can land, a crash of any
live party before any of its operations (its unsent cleanups die with it) and
a batch's keys landing one by one with other parties' operations between them.
States already seen (the store, the clock, each party's history of answers)
are not explored again.

At each end state it runs a reader that comes later (after every lease has
lapsed) until the mailbox is empty, lets every expiry pass with a reaper's
sweep, and checks the delivery rule:

- no record delivered (or ended by a replace or a discard) twice;
- no record lost: every record whose post returned was delivered, replaced,
  discarded, recovered by the later reader, or committed by a reader that
  crashed inside its confirm (delivered to a reader that then died);
- no record of a post that raised was ever delivered;
- nothing left in the store but what the protocol states: the keys of a
  producer that crashed mid-post (left to their expiry) and, with no expiry,
  the record of a committer that crashed between its commit and its cleanup.

``run`` answers a ``Report`` with the counts and the first violation of each
kind, its schedule written out, so a failure says how to reproduce it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.handoff.model import ModelStore
from mooncake_diffusion.handoff.protocol import Now, Op, Pause, Remove
from mooncake_diffusion.transfer.leases import ttl_marker

BIG_MS = 10**12  # far past every expiry


@dataclass(frozen=True)
class Phase:
    """Not a store operation: a party says where it is (``"confirm"``: from here on a
    crash counts as a crash after its delivery point)."""

    name: str


PartyGen = Generator[Any, Any, Any]


@dataclass
class Party:
    """One participant: ``make()`` builds its generator; ``kind`` is "producer",
    "reader", "taker" or "clock"; ``record`` the bytes a producer posts."""

    name: str
    kind: str
    make: Callable[[], PartyGen]
    record: bytes = b""


@dataclass
class _Live:
    party: Party
    gen: PartyGen | None
    answer: Any = None
    pending: Op | None = None  # the operation it yielded, not yet answered
    batch: list[Op] = field(default_factory=list)  # one-key steps of a split batch
    answers: list[Any] = field(default_factory=list)
    cleanups: list[Op] = field(default_factory=list)  # Remove(later=True), unsent
    history: Any = b""
    phase: str = ""
    done: bool = False
    crashed: bool = False
    crashed_in: str = ""
    result: Any = None
    error: str = ""
    held: bytes | None = None
    removed: set[str] = field(default_factory=set)  # keys this party's removals took


@dataclass
class Report:
    states: int = 0
    ends: int = 0
    violations: dict[str, str] = field(default_factory=dict)  # kind -> first example

    def add(self, kind: str, what: str, schedule: list[str]) -> None:
        self.violations.setdefault(kind, f"{what}; schedule: {' '.join(schedule)}")


class Explorer:
    """Explore ``parties`` from the store ``setup`` leaves (see the module docstring).

    ``payload_of(record)`` names the payload key a record stands for (removed by
    whoever commits it); ``recover()`` builds the later reader's generator
    (answers a record or ``None``); ``crashes``: how many parties may crash in one
    run; ``split``: batches land key by key; ``excused(record, parties)``: a record
    nobody surviving got may be missing (its commit was a crashed party's);
    ``allowed_left(key, parties)``: what may stay after the final sweep;
    ``strict``: with no crash, nothing at all may stay even before that sweep."""

    def __init__(
        self,
        parties: list[Party],
        *,
        setup: Callable[[ModelStore], None],
        excused: Callable[[bytes, list[_Live]], bool],
        recover: Callable[[], PartyGen],
        names: list[str],
        crashes: int = 1,
        split: bool = True,
        capacity: int | None = None,
        max_states: int = 2_000_000,
        allowed_left: Callable[[str, list[_Live]], bool] | None = None,
        strict: bool = True,
        check: Callable[[list[_Live]], list[str]] | None = None,
    ) -> None:
        self.parties = parties
        self.setup = setup
        self.excused = excused
        self.recover = recover
        self.names = names
        self.crashes = crashes
        self.split = split
        self.capacity = capacity
        self.max_states = max_states
        self.allowed_left = allowed_left
        self.strict = strict
        self.check = check
        self._has_clock = any(p.kind == "clock" for p in parties)
        self.report = Report()
        #: records posted by ``setup``: each must be delivered once too
        self.expected: list[bytes] = []
        self._seen: set[bytes] = set()

    # ------------------------------------------------------------ the search
    def run(self) -> Report:
        self._explore([])
        return self.report

    def _fresh(self) -> tuple[ModelStore, list[_Live]]:
        store = ModelStore(capacity=self.capacity)
        self.setup(store)
        lives = [_Live(p, p.make()) for p in self.parties]
        for live in lives:
            self._advance(store, live)
        return store, lives

    def _explore(self, schedule: list[str]) -> None:
        stack = [schedule]
        while stack:
            prefix = stack.pop()
            store, lives = self._fresh()
            for choice in prefix:
                self._do(store, lives, choice)
            key = self._key(store, lives)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.report.states += 1
            if self.report.states > self.max_states:
                raise RuntimeError(f"more than {self.max_states} states: make the scenario smaller")
            choices = self._choices(lives, prefix)
            if not choices:
                self.report.ends += 1
                self._check_end(store, lives, prefix)
                continue
            stack.extend([*prefix, c] for c in reversed(choices))

    def _choices(self, lives: list[_Live], prefix: list[str]) -> list[str]:
        out = []
        crashed = sum(1 for live in lives if live.crashed)
        for i, live in enumerate(lives):
            if live.crashed:
                continue
            if not live.done:
                out.append(f"s{i}")
            if live.cleanups:
                out.append(f"c{i}")
            # no crash inside a batch: the master finishes an operation it was sent
            if (
                crashed < self.crashes
                and live.party.kind != "clock"
                and not live.batch
                and (not live.done or live.cleanups)
            ):
                out.append(f"x{i}")
        return out

    def _do(self, store: ModelStore, lives: list[_Live], choice: str) -> None:
        kind, i = choice[0], int(choice[1:])
        live = lives[i]
        if kind == "x":
            live.crashed = True
            live.crashed_in = live.phase
            live.cleanups.clear()
            return
        if kind == "c":
            op = live.cleanups.pop(0)
            self._apply(store, live, op)
            live.history = _h(live.history, ("c", op))
            return
        if live.batch:  # the next key of a split batch
            sub = live.batch.pop(0)
            live.answers.extend(self._apply(store, live, sub))
            if not live.batch:
                self._answered(store, live, tuple(live.answers))
            return
        op = live.pending
        assert op is not None
        steps = list(store.steps(op)) if self.split and _width(op) > 1 else [op]
        if len(steps) > 1:  # a batch landing key by key
            live.batch, live.answers = steps[1:], []
            live.answers.extend(self._apply(store, live, steps[0]))
            return
        if isinstance(op, Jump):
            store.now_ms += op.ms
            self._answered(store, live, None)
            return
        self._answered(store, live, self._apply(store, live, op))

    @staticmethod
    def _apply(store: ModelStore, live: _Live, op: Op) -> Any:
        """Answer ``op`` and note the keys this party removed (for the checks)."""
        answer = store.apply(op)
        if isinstance(op, Remove):
            live.removed.update(k for k, gone in zip(op.keys, answer, strict=True) if gone)
        return answer

    def _answered(self, store: ModelStore, live: _Live, answer: Any) -> None:
        live.history = _h(live.history, (live.pending, answer))
        live.answer = answer
        live.pending = None
        self._advance(store, live)

    def _advance(self, store: ModelStore, live: _Live) -> None:
        """Run the party up to its next store operation (answering what needs no
        store: phases, later cleanups, a clock's jumps)."""
        assert live.gen is not None
        while True:
            try:
                op = live.gen.send(live.answer)
            except StopIteration as stop:
                live.done, live.result = True, stop.value
                return
            except MooncakeDiffusionError as e:
                live.done, live.error = True, type(e).__name__
                return
            live.answer = None
            if isinstance(op, Pause):
                continue  # touches no store: not a point another party can land at
            if isinstance(op, Now) and not self._has_clock:
                live.answer = store.now_ms
                continue
            if isinstance(op, Phase):
                live.phase = op.name
                continue
            if isinstance(op, Held_):
                live.held = op.record
                continue
            if isinstance(op, Remove) and op.later:
                live.cleanups.append(Remove(op.keys))
                live.answer = tuple(True for _ in op.keys)
                continue
            live.pending = op  # a store operation, or a clock's jump: a scheduled step
            return

    def _key(self, store: ModelStore, lives: list[_Live]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((store.snapshot(), store.now_ms)).encode())
        for live in lives:
            h.update(
                repr(
                    (live.history, live.crashed, live.done, len(live.batch), live.cleanups)
                ).encode()
            )
        return h.digest()

    # ------------------------------------------------------------ the checks
    def _check_end(self, store: ModelStore, lives: list[_Live], schedule: list[str]) -> None:
        store.now_ms += 10 * 60_000  # every lease lapsed; no expiry passed yet
        recovered: list[bytes] = []
        for name in self.names:
            for _ in range(8):
                got = _drive(store, self.recover_for(name))
                if got is None:
                    break
                recovered.append(got)
        delivered: dict[bytes, int] = {}  # to readers (and the later reader)
        ended: dict[bytes, int] = {}  # delivered, replaced or discarded
        for live in lives:
            if not isinstance(live.result, bytes):
                continue
            if live.party.kind in ("reader", "taker"):
                delivered[live.result] = delivered.get(live.result, 0) + 1
            ended[live.result] = ended.get(live.result, 0) + 1
        for rec in recovered:
            delivered[rec] = delivered.get(rec, 0) + 1
            ended[rec] = ended.get(rec, 0) + 1
        if self.check is not None:
            for what in self.check(lives):
                self.report.add("rule", what, schedule)
        for rec, n in ended.items():
            if n > 1:
                self.report.add("twice", f"{rec!r} delivered or replaced {n} times", schedule)
        posted = list(self.expected)
        for live in lives:
            if live.party.kind != "producer":
                continue
            rec = live.party.record
            if live.error and delivered.get(rec):
                self.report.add("failed-delivered", f"{rec!r}: post raised, delivered", schedule)
            if live.done and not live.error:
                posted.append(rec)
        for rec in posted:
            if not ended.get(rec) and not self.excused(rec, lives):
                self.report.add("lost", f"{rec!r} posted, never delivered", schedule)
        if self.strict and not any(live.crashed for live in lives) and store.keys:
            # nobody crashed: everything is gone now, with no reaper's help
            self.report.add("orphan", f"left with no crash: {sorted(store.keys)}", schedule)
        store.now_ms += BIG_MS  # every expiry passed: a reaper's sweep
        store.sweep()
        left = [
            k
            for k in store.keys
            if not (self.allowed_left is not None and self.allowed_left(k, lives))
        ]
        if left:
            self.report.add("orphan", f"left in the store: {sorted(left)}", schedule)

    def recover_for(self, name: str) -> PartyGen:
        return self.recover(name)


@dataclass(frozen=True)
class Held_:
    """Not a store operation: a reader says which record it holds (for the checks)."""

    record: bytes


@dataclass(frozen=True)
class Jump:
    """Not a store operation: the clock moves ``ms`` forward (a clock party's step)."""

    ms: int


def clock(ms: int) -> PartyGen:
    """A party whose one step moves the clock ``ms`` forward (past every lease)."""
    yield Jump(ms)


def _width(op: Op) -> int:
    return len(getattr(op, "items", None) or getattr(op, "keys", None) or (0,))


def _h(prev: Any, item: Any) -> bytes:
    return hashlib.blake2b(repr((prev, item)).encode(), digest_size=12).digest()


def _drive(store: ModelStore, gen: PartyGen) -> Any:
    """Run ``gen`` alone to its end against ``store``."""
    answer: Any = None
    while True:
        try:
            op = gen.send(answer)
        except StopIteration as stop:
            return stop.value
        if isinstance(op, Phase | Held_):
            answer = None
        elif isinstance(op, Jump):
            store.now_ms += op.ms
            answer = None
        else:
            answer = store.apply(op)


def marker_of(key: str, ms: int) -> str:
    return ttl_marker(ms, key)

"""The orchestrator's journal: accepted events in SQLite, replayed after a restart.

The core is deterministic (the same ``(event, now)`` sequence gives the same
actions and state), so the journal is an event log, not a state dump:

    jo = JournaledOrchestrator.open("orch.db", config, clock=MonotonicClock())
    for d in jo.recovered_dispatches:       # after a restart: what the journal says is
        send(d.worker_id, d.item)           #   running; workers ignore what they hold
    actions = jo.handle(Submit("r1"))       # runs the core, commits, then returns
    jo.next_deadline(); jo.now()            # same time base: handle(Tick()) at the deadline
    jo.close()                              # or crash: committed events are on disk

``handle`` reads the clock once, runs the core at that time, commits the event
(one transaction) and only then returns the actions, so the driver never acts on
an event the journal could lose. Group commit: inside ``with jo.group():`` the
events are committed together when the block exits (one write for many events);
the driver then holds back every effect of their actions until the block has
exited without error (the service does, per turn of its loop). Which events are written:
- an event the core accepted: as given (after a msgpack round trip, see below);
- an event the core rejected: nothing, unless expiring workers at that time
  changed the state; then a ``Tick`` at the same time, which replays the same
  changes (a rejected event changes nothing itself);
- an event that does not survive encoding as the ``Event`` union (wrong field
  types): answered with ``Rejected`` without reaching the core. The core is
  always fed the decoded copy, so replay sees exactly what it saw.

Recovery (``open`` on an existing journal) replays every event into a fresh
core and discards the actions: the previous process already executed them. The
driver then learns what the state expects:
- ``recovered_dispatches``: the items the journal says are running. The driver
  re-sends them (a crash may have come between commit and send); a worker that
  already runs that ``(request, stage, attempt)`` ignores the copy.
- Workers must make contact again: a live worker heartbeats (its
  ``RegisterWorker`` would be rejected as ``duplicate_worker``); a worker that
  lost its items sends ``WorkerLost`` for itself, then registers. Items on
  workers that never come back are re-queued by the core's heartbeat deadline
  rule (at least once); late results of old attempts are rejected as
  ``stale_attempt``, so duplicates are dropped.
- One writer: a journal is held with ``flock`` on ``<path>.lock`` while open;
  a second orchestrator on the same file gets ``JournalError``. The lock dies
  with its process, so a crashed orchestrator never blocks its recovery.
- Time never goes back, and downtime is not silence: the core resumes at the
  journal's last event time (``now()`` is ``clock.now() + offset``, the offset
  chosen at recovery), whatever the clock did meanwhile (a reboot resets the
  monotonic clock; a new leader's wall clock differs). Workers could not reach
  a stopped orchestrator, so the downtime is invisible to deadlines: a live
  worker's heartbeat deadline is where the journal left it, and the driver's
  first heartbeat for it (as if it had just made contact) gives it a full
  timeout from the resumed time.

Durability: WAL mode with ``synchronous=NORMAL``. A committed transaction
survives a process crash; a power loss or OS crash may lose the last commits
(never corrupt the file). Checkpoints (copying the log into the database file,
with its fsyncs) run on a thread of their own, a passive one every 0.2 s while
the journal is written, not inside the commit that crosses SQLite's 1,000-page
mark, where they cost the driver 5-6 ms every half second at 1,000
submissions/s (``docs/performance.md``). A passive checkpoint never waits for
the writer; the log starts again from its beginning at the first write after
one that copied all of it, and if a steady writer never leaves such a moment,
the writer checkpoints itself once the log holds 16,384 pages (64 MiB).
Obligations: one process writes a journal at a time (nothing here locks it
against a second orchestrator); the journal is bound to
the ``OrchestratorConfig`` it was written under, and the routing policy must be
a fresh instance of the same deterministic policy. Compaction (snapshots, log
truncation) is out of scope: the log grows and recovery replays it all.
Not thread-safe: one driver thread, like the core.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator
from os import PathLike
from types import TracebackType
from typing import Protocol, get_args

import msgspec

from mooncake_diffusion.orchestrator.core.clock import Clock
from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import (
    Action,
    CoreSnapshot,
    Dispatch,
    Event,
    OrchestratorConfig,
    Rejected,
    ReleasePayloads,
    Tick,
)
from mooncake_diffusion.orchestrator.core.routing import RoutingPolicy
from mooncake_diffusion.orchestrator.errors import (
    ClockError,
    OrchestratorError,
    PolicyContractError,
)

__all__ = [
    "JOURNAL_SCHEMA_VERSION",
    "EventLog",
    "Journal",
    "JournalError",
    "JournaledOrchestrator",
]

#: Version of the tables below. 1: meta(key, value); events(seq, now, event msgpack).
JOURNAL_SCHEMA_VERSION = 1

log = logging.getLogger("mooncake_diffusion.orchestrator.journal")  # its name before the move

#: Seconds between the checkpointer's passes while the journal is being written.
CHECKPOINT_EVERY = 0.2
#: The writer's own checkpoint, a fallback (module docstring): pages in the log.
WAL_FALLBACK_PAGES = 16_384

_EVENT_TYPES: tuple[type, ...] = get_args(Event)
_TICK = msgspec.msgpack.encode(Tick())
_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE events (seq INTEGER PRIMARY KEY, now REAL NOT NULL, event BLOB NOT NULL)",
)


class JournalError(OrchestratorError):
    """The journal cannot be opened, read or written: not a journal, an unknown schema
    version, another config, a corrupt event (the message names its seq), or a failed
    write. Not retryable on the same object: reopen (recover) to go on."""


def _lock(path: str) -> int:
    """Hold ``path + ".lock"`` exclusively; a second writer gets ``JournalError``.

    ``flock`` locks die with their process, so a crashed orchestrator never
    blocks its own recovery.
    """
    lock_path = path + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise JournalError(f"journal {path}: cannot open lock file {lock_path}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise JournalError(
            f"journal {path} is in use by another orchestrator (lock {lock_path})"
        ) from None
    return fd


class _Checkpointer:
    """Passive checkpoints of one journal's log, from a thread and a connection of its
    own, every ``CHECKPOINT_EVERY`` seconds after ``written`` was called (a plain
    flag: nothing on the writer's path waits or wakes a thread). ``close`` stops and
    joins the thread. A failure is logged and ends the thread (the writer's fallback
    checkpoint takes over); the events are durable in the log either way."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="journal-checkpoint", daemon=True)
        self._thread.start()

    def written(self) -> None:
        self._dirty = True

    def _run(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as e:
            log.warning("journal %s: checkpointer cannot open it: %s", self.path, e)
            return
        try:
            db.execute("PRAGMA synchronous=NORMAL")
            while not self._stop.wait(CHECKPOINT_EVERY):
                if self._dirty:
                    self._dirty = False
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as e:  # the writer's fallback checkpoint takes over
            log.warning("journal %s: checkpointer stopped: %s", self.path, e)
        finally:
            db.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class EventLog(Protocol):
    """What ``JournaledOrchestrator`` needs of a journal (``Journal`` below is the
    SQLite one; ``ha.service.EtcdJournal`` the replicated one). ``append`` between
    ``begin`` and ``commit`` joins that transaction; ``commit`` raises
    ``JournalError`` when the events are not durable (act on none of them)."""

    path: str

    def encode(self, event: Event) -> tuple[Event, bytes]: ...
    def bind_config(self, config: OrchestratorConfig) -> None: ...
    def append(self, now: float, blob: bytes) -> int: ...
    def begin(self) -> None: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...
    def replay(self) -> Iterator[tuple[int, float, Event]]: ...
    def close(self) -> None: ...


class Journal:
    """An append-only log of ``(seq, now, event)`` in an SQLite file.

    Opens or creates ``path``; raises ``JournalError`` for a file that is not a
    journal or has an unknown schema version. ``append`` commits one event per
    call (blocks for the write; no fsync per commit, see the module docstring),
    or, between ``begin`` and ``commit``, adds it to that one transaction. The
    first write starts the checkpointer thread. Call ``close`` (or use it as a
    context manager) when done: it stops that thread.
    """

    def __init__(self, path: str | PathLike[str]) -> None:
        self.path = str(path)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Event)
        # one writer per journal, for the object's lifetime (released on close or GC)
        self._unlock = weakref.finalize(self, os.close, _lock(self.path))
        self._checkpointer: _Checkpointer | None = None
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as e:
            self._release_lock()
            raise JournalError(f"journal {self.path}: cannot open: {e}") from e
        try:
            self._setup()
        except BaseException:
            self._db.close()
            self._release_lock()
            raise

    def _release_lock(self) -> None:
        """Drop the writer lock (what the OS does when the writer's process dies)."""
        self._unlock()  # idempotent

    def _setup(self) -> None:
        db = self._db
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise JournalError(f"journal {self.path}: cannot use WAL mode (got {mode!r})")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_FALLBACK_PAGES}")
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                db.execute("BEGIN IMMEDIATE")
                for stmt in _SCHEMA:
                    db.execute(stmt)
                db.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?)", (str(JOURNAL_SCHEMA_VERSION),)
                )
                db.execute("COMMIT")
                return
            row = None
            if "meta" in tables:
                q = "SELECT value FROM meta WHERE key = 'schema_version'"
                row = db.execute(q).fetchone()
        except sqlite3.Error as e:
            raise JournalError(f"journal {self.path}: not a readable SQLite journal: {e}") from e
        if row is None:
            raise JournalError(f"journal {self.path}: not an orchestrator journal (no version)")
        if row[0] != str(JOURNAL_SCHEMA_VERSION):
            raise JournalError(
                f"journal {self.path}: schema version {row[0]!r} is not supported "
                f"(this code reads version {JOURNAL_SCHEMA_VERSION})"
            )

    # ------------------------------------------------------------------ meta
    def bind_config(self, config: OrchestratorConfig) -> None:
        """Record ``config`` in an empty journal; raise ``JournalError`` if the journal
        was written under another one (replaying under it would build another state)."""
        text = msgspec.json.encode(config).decode()
        row = self._db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('config', ?)", (text,))
        elif row[0] != text:
            raise JournalError(
                f"journal {self.path} was written under another OrchestratorConfig: "
                f"{row[0]} (given {text})"
            )

    # ------------------------------------------------------------------ events
    def encode(self, event: Event) -> tuple[Event, bytes]:
        """The event as replay will see it, and its bytes. Raises ``TypeError`` if it
        cannot be encoded, ``msgspec.ValidationError`` if a field has the wrong type."""
        blob = self._enc.encode(event)
        return self._dec.decode(blob), blob

    def append(self, now: float, blob: bytes) -> int:
        """Commit one encoded event at ``now`` (one transaction, or part of the one
        ``begin`` opened); returns its seq."""
        try:
            cur = self._db.execute("INSERT INTO events (now, event) VALUES (?, ?)", (now, blob))
        except sqlite3.Error as e:
            raise JournalError(f"journal {self.path}: write failed: {e}") from e
        assert cur.lastrowid is not None
        self._written()
        return cur.lastrowid

    def _written(self) -> None:
        ck = self._checkpointer
        if ck is None:
            ck = self._checkpointer = _Checkpointer(self.path)
            self._stop_checkpointer = weakref.finalize(self, ck.close)
        ck.written()

    def begin(self) -> None:
        """Open a transaction: ``append`` calls until ``commit`` are written together."""
        try:
            self._db.execute("BEGIN")
        except sqlite3.Error as e:
            raise JournalError(f"journal {self.path}: begin failed: {e}") from e

    def commit(self) -> None:
        """Commit the transaction ``begin`` opened (one write for all its events)."""
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            raise JournalError(f"journal {self.path}: commit failed: {e}") from e

    def rollback(self) -> None:
        """Drop the open transaction's events, if any (best effort: the journal is
        being given up on)."""
        with contextlib.suppress(sqlite3.Error):
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")

    def __len__(self) -> int:
        """The number of events journaled."""
        return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])

    def replay(self) -> Iterator[tuple[int, float, Event]]:
        """Every ``(seq, now, event)`` in seq order; ``JournalError`` names a corrupt seq."""
        for seq, now, blob in self._db.execute("SELECT seq, now, event FROM events ORDER BY seq"):
            if not isinstance(now, float | int) or not isinstance(blob, bytes):
                raise JournalError(f"journal {self.path}: event seq {seq} is corrupt: bad row")
            try:
                event = self._dec.decode(blob)
            except msgspec.DecodeError as e:  # ValidationError is a DecodeError
                raise JournalError(f"journal {self.path}: event seq {seq} is corrupt: {e}") from e
            yield seq, float(now), event

    def close(self) -> None:
        """Stop the checkpointer, close the file and release the writer lock
        (idempotent). Committed events are already on disk."""
        if self._checkpointer is not None:
            self._stop_checkpointer()
        self._db.close()
        self._release_lock()

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class JournaledOrchestrator:
    """An ``Orchestrator`` whose accepted events are journaled before their actions
    are returned. Build it with ``open``; the call sequence is in the module docstring.
    """

    def __init__(self, journal: EventLog, core: Orchestrator, clock: Clock, offset: float) -> None:
        """Use ``open``. ``offset`` is added to every ``clock.now()``."""
        self.journal = journal
        self.core = core
        self._clock = clock
        self._offset = offset
        self._broken: JournalError | None = None
        #: The items running when the journal was recovered (empty for a new journal).
        self.recovered_dispatches: tuple[Dispatch, ...] = ()

    @classmethod
    def open(
        cls,
        path: str | PathLike[str],
        config: OrchestratorConfig | None = None,
        *,
        clock: Clock,
        policy: RoutingPolicy | None = None,
        observer: Callable[[Event, list[Action]], None] | None = None,
    ) -> JournaledOrchestrator:
        """Open or create the journal at ``path`` and recover its state.

        ``policy``: a fresh routing policy (default: ``config.policy`` from the
        registry). ``observer(event, actions)`` sees every replayed event with the
        actions it produced (not to execute: to rebuild a driver's own views, such
        as client-visible request statuses). Raises ``JournalError`` if the journal
        is unusable, was written under another config, or does not replay (a
        corrupt event; time going back).
        """
        return cls.recover(Journal(path), config, clock=clock, policy=policy, observer=observer)

    @classmethod
    def recover(
        cls,
        journal: EventLog,
        config: OrchestratorConfig | None = None,
        *,
        clock: Clock,
        policy: RoutingPolicy | None = None,
        observer: Callable[[Event, list[Action]], None] | None = None,
    ) -> JournaledOrchestrator:
        """``open`` on a journal object already opened (the SQLite ``Journal``, or
        another ``EventLog`` such as ``ha.service.EtcdJournal``); it is closed if
        recovery fails."""
        config = config if config is not None else OrchestratorConfig()
        try:
            journal.bind_config(config)
            core = Orchestrator(config, policy=policy)
            last = _Recovery()
            for seq, now, event in journal.replay():
                try:
                    actions = core.handle(event, now=now)
                except ClockError as e:
                    msg = f"journal {journal.path}: event seq {seq} does not replay: {e}"
                    raise JournalError(msg) from e
                except PolicyContractError as e:  # raised live too; the state is consistent
                    actions = e.actions
                last.track(actions)
                if observer is not None:
                    observer(event, actions)
            # resume at the last journaled time (core.now is -inf if nothing replayed)
            offset = core.now - clock.now() if math.isfinite(core.now) else 0.0
            jo = cls(journal, core, clock, offset)
            jo.recovered_dispatches = last.running(core.snapshot())
            return jo
        except BaseException:
            journal.close()
            raise

    @property
    def config(self) -> OrchestratorConfig:
        return self.core.config

    def now(self) -> float:
        """The time ``handle`` would use now, in the core's time base."""
        return self._clock.now() + self._offset

    def handle(self, event: Event) -> list[Action]:
        """Apply ``event`` at ``now()``, journal it (see the module docstring), then
        return the actions to execute in order.

        Raises ``JournalError`` if the commit failed: the actions are lost and this
        object refuses every later call; reopen the journal to recover. Raises the
        core's ``ClockError`` (nothing journaled) and ``PolicyContractError`` (the
        event is journaled, its actions are on the exception) unchanged.
        """
        if self._broken is not None:
            raise JournalError(f"journal {self.journal.path}: unusable after {self._broken}")
        if not isinstance(event, _EVENT_TYPES):
            name = type(event).__name__
            return [Rejected("bad_event", f"{name} is not an orchestrator event", name)]
        name = type(event).__name__
        try:
            event, blob = self.journal.encode(event)
        except (TypeError, msgspec.ValidationError) as e:
            return [Rejected("bad_value", f"{name} cannot be journaled: {e}", name)]
        now = self.now()
        try:
            actions = self.core.handle(event, now=now)
        except PolicyContractError:
            self._commit(now, blob)
            raise
        if any(isinstance(a, Rejected) for a in actions):
            if len(actions) > 1:  # workers expired at ``now``: replay that much
                self._commit(now, _TICK)
        else:
            self._commit(now, blob)
        return actions

    @property
    def broken(self) -> JournalError | None:
        """The write failure that made this object unusable, or None."""
        return self._broken

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Group commit: the events handled inside the block are committed together
        when it exits (one transaction, one write) instead of one by one.

        Obligation of the caller: act on none of the actions returned inside the
        block until it has exited without raising (buffer frames, answers and
        notifications; execute them after). If a write or the commit fails, the
        block raises ``JournalError`` (nothing of the block is durable; this object
        refuses every later call). An exception of another kind still commits what
        the core applied, so the journal keeps matching the core, then propagates.
        """
        if self._broken is not None:
            raise JournalError(f"journal {self.journal.path}: unusable after {self._broken}")
        try:
            self.journal.begin()
        except JournalError as e:
            self._broken = e
            raise
        try:
            yield
        finally:
            if self._broken is not None:
                self.journal.rollback()
            else:
                try:
                    self.journal.commit()
                except JournalError as e:
                    self._broken = e
                    self.journal.rollback()
                    raise
        if self._broken is not None:
            raise JournalError(f"journal {self.journal.path}: {self._broken}")

    def _commit(self, now: float, blob: bytes) -> None:
        try:
            self.journal.append(now, blob)
        except JournalError as e:
            self._broken = e
            raise

    def next_deadline(self) -> float | None:
        """As ``Orchestrator.next_deadline``, in the time base of ``now()``."""
        return self.core.next_deadline()

    def snapshot(self) -> CoreSnapshot:
        return self.core.snapshot()

    def live_workers(self) -> list[str]:
        return self.core.live_workers()

    def is_live(self, worker_id: str) -> bool:
        return self.core.is_live(worker_id)

    def close(self) -> None:
        """Close the journal (idempotent). Every returned action's event is committed."""
        self.journal.close()

    def __enter__(self) -> JournaledOrchestrator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Recovery:
    """During replay: the last dispatch of each live request."""

    def __init__(self) -> None:
        self.dispatches: dict[str, Dispatch] = {}

    def track(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                self.dispatches[a.item.request_id] = a
            elif isinstance(a, ReleasePayloads):
                self.dispatches.pop(a.request_id, None)

    def running(self, snap: CoreSnapshot) -> tuple[Dispatch, ...]:
        out = []
        for r in snap.requests:
            if r.state == "running":
                d = self.dispatches[r.request_id]
                assert (d.worker_id, d.item.stage, d.item.attempt) == (
                    r.worker_id,
                    r.stage,
                    r.attempt,
                ), (d, r)
                out.append(d)
        return tuple(out)

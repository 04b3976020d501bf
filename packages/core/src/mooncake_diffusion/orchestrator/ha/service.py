"""The orchestrator service on etcd: one leader serves, standbys follow its journal.

    mooncake-diffusion orchestrator --etcd 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379 \\
        --host 10.0.0.5 --token T          # on each orchestrator host; any number of them

Each process is a ``Candidate`` (``election.py``) on ``<prefix>/leader``. A standby
campaigns and meanwhile reads the journal (``EtcdJournal.follow``), so that taking
over reads only its tail. The winner rebuilds the core by replaying the whole
journal (``JournaledOrchestrator.recover``: the same replay as after a restart on
SQLite), binds its worker and API ports, then announces their addresses in the
leader key's value (``Announcement``); workers and clients follow that
(``link/follow.py``). Requests are not lost in a failover: an accepted request's
``Submit`` was committed before the client got its answer, the new leader replays
it, re-sends what was running and dispatches what was queued; a client that got no
answer resubmits under the same id and gets it back (``duplicate_request`` means
accepted).

Commit: every accepted event is in etcd before its actions are returned. The batch
is the service's group commit, one driver turn (every worker frame and API call
ready at one poll, up to 64 frames): its events are msgpack-packed into one value
per ``CHUNK_BYTES`` and each value is one etcd transaction guarded by the fencing
token (``Candidate.put_entry``). Usually one transaction per turn. A transaction
etcd does not answer (a Raft election) is retried under the same key, which it
creates only if absent, so it is written at most once; the driver waits meanwhile.

Fencing, both ways:
- in etcd: a transaction commits only while the leader key has this term's create
  revision, so a deposed leader commits nothing; its driver then stops (a failed
  commit stops the service) and no effect of an uncommitted event goes out;
- on the wire: the leader stops before its lease can lapse. ``LeaseKeeper`` renews
  every ``lease/4`` and keeps ``valid_until`` = send time of the last successful
  renewal + lease - ``margin``: etcd counts the lease from the later moment it
  received that renewal, so ``valid_until`` comes first. No frame leaves after
  ``valid_until`` (``LeaderService._push_frame``): the driver waits up to a lease
  for a renewal that finds the key still this term's, else the service stops.
  Workers do not check a token: they talk to one leader at a time (the announced
  one) and only a committed event's actions reach them.
A deposed process becomes a standby again.

Time: the core's clock is the wall clock (``WallClock``), so that a standby on
another host continues the time base (hosts on NTP); recovery resumes the core's
time at the journal's last event (the journal's offset rule, as after a restart
on SQLite), so the takeover is not counted against workers' heartbeat deadlines,
nor requests' deadlines. The journal grows without compaction, as the SQLite one.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Dispatch,
    Event,
    OrchestratorConfig,
    Rejected,
    RequestCompleted,
    Submit,
    WorkerRemoved,
)
from mooncake_diffusion.orchestrator.ha.election import Candidate
from mooncake_diffusion.orchestrator.link.follow import DEFAULT_PREFIX, Announcement
from mooncake_diffusion.orchestrator.service.journal import (
    EventLog,
    Journal,
    JournaledOrchestrator,
    JournalError,
)
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.platform.etcd import EtcdClient, EtcdUnavailableError, prefix_end

__all__ = [
    "CHUNK_BYTES",
    "EtcdJournal",
    "HaOptions",
    "LeaderService",
    "LeaseKeeper",
    "WallClock",
    "audit",
    "serve",
]

log = logging.getLogger("mooncake_diffusion.orchestrator")

#: the most event bytes in one journal value (etcd refuses requests over 1.5 MiB)
CHUNK_BYTES = 512 << 10
_Batch = list[tuple[float, bytes]]


class WallClock:
    """``time.time()`` that never goes back (a step back holds the last value). A new
    leader's core resumes at the journal's last event whatever this reads
    (``JournaledOrchestrator.recover``)."""

    def __init__(self) -> None:
        self._last = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            self._last = max(self._last, time.time())
            return self._last


def _b64(raw: str | bytes) -> str:
    return base64.b64encode(raw.encode() if isinstance(raw, str) else raw).decode()


class EtcdJournal:
    """An ``EventLog`` in etcd under ``<prefix>/journal/``, written through
    ``candidate`` (only while it leads). Entries are batches of ``(now, event)``."""

    def __init__(self, candidate: Candidate, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.candidate = candidate
        self.etcd: EtcdClient = candidate.etcd
        self.path = f"etcd:{candidate.journal_prefix}"
        self._config_key = candidate.leader_key.rsplit("/", 1)[0] + "/config"
        self._chunk = chunk_bytes
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Event)
        self._batch_dec = msgspec.msgpack.Decoder(_Batch)
        self._batch: _Batch | None = None
        self._seq = 0
        self._followed: list[tuple[float, bytes]] = []
        self._after = ""
        #: etcd transactions this object committed
        self.commits = 0
        #: how long a commit is retried while etcd does not answer (``_put``)
        self.retry_s = 2.0 * candidate.ttl_s
        #: whether the lease is known lost (the leader sets it; retries stop then)
        self.lost: Callable[[], bool] = lambda: False

    encode = Journal.encode

    def bind_config(self, config: OrchestratorConfig) -> None:
        text = msgspec.json.encode(config).decode()
        try:
            have = self.etcd.get(self._config_key)
            if have is None:
                self.etcd.put(self._config_key, text)
        except EtcdUnavailableError as e:
            raise JournalError(f"journal {self.path}: etcd unreachable: {e}") from e
        if have is not None and have.decode() != text:
            raise JournalError(
                f"journal {self.path} was written under another OrchestratorConfig: "
                f"{have.decode()} (given {text})"
            )

    def append(self, now: float, blob: bytes) -> int:
        self._seq += 1
        if self._batch is None:
            self._write([(now, blob)])
        else:
            self._batch.append((now, blob))
        return self._seq

    def begin(self) -> None:
        self._batch = []

    def commit(self) -> None:
        batch, self._batch = self._batch or [], None
        if batch:
            self._write(batch)

    def rollback(self) -> None:
        self._batch = None

    def _write(self, batch: _Batch) -> None:
        """One guarded transaction per chunk, in order. A chunk that fails raises: the
        chunks before it are committed (the next leader replays them), no effect of
        any of them goes out from here."""
        start, size = 0, 0
        for i, (_, blob) in enumerate(batch):
            size += len(blob) + 16
            if size > self._chunk and i > start:
                self._put(batch[start:i])
                start, size = i, len(blob) + 16
        self._put(batch[start:])

    def _put(self, events: _Batch) -> None:
        """One entry, retried under the same key while etcd does not answer (a Raft
        election takes a second or two; the lease outlives it) for up to ``retry_s``
        and until ``lost()``: a term's entry is written at most once."""
        key, value = self.candidate.next_key(), self._enc.encode(events)
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                written = self.candidate.put_entry(key, value)
                break
            except EtcdUnavailableError as e:
                if time.monotonic() >= deadline or self.lost():
                    raise JournalError(f"journal {self.path}: etcd did not answer: {e}") from e
                time.sleep(0.05)
        if not written:
            raise JournalError(
                f"journal {self.path}: not committed: this orchestrator lost the lease"
            )
        self.commits += 1

    def follow(self) -> int:
        """Read the entries committed since the last call (a standby calls it while it
        waits); returns how many events came. Raises ``EtcdUnavailableError``."""
        prefix = self.candidate.journal_prefix
        came = 0
        while True:
            start = (self._after + "\0") if self._after else prefix
            body = {"key": _b64(start), "range_end": _b64(prefix_end(prefix)), "limit": 64}
            out = self.etcd.call("kv/range", body, timeout=5.0)
            kvs = out.get("kvs") or []
            assert isinstance(kvs, list)
            for kv in kvs:
                self._after = base64.b64decode(kv["key"]).decode()
                try:
                    events = self._batch_dec.decode(base64.b64decode(kv.get("value", "")))
                except msgspec.DecodeError as e:
                    raise JournalError(f"journal {self.path}: entry {self._after}: {e}") from e
                self._followed.extend(events)
                came += len(events)
            if not out.get("more"):
                return came

    def replay(self) -> Iterator[tuple[int, float, Event]]:
        try:
            self.follow()
        except EtcdUnavailableError as e:
            raise JournalError(f"journal {self.path}: etcd unreachable: {e}") from e
        for seq, (now, blob) in enumerate(self._followed, 1):
            try:
                event = self._dec.decode(blob)
            except msgspec.DecodeError as e:
                raise JournalError(f"journal {self.path}: event {seq} is corrupt: {e}") from e
            yield seq, now, event

    def close(self) -> None:
        """Nothing to close: the candidate (and its lease) belong to the caller."""


class LeaseKeeper:
    """Renews ``candidate``'s lease every ``lease/4`` on a thread and says until when
    this process surely still leads (``valid``; module docstring). ``lost`` is set
    once a renewal finds the lease or the key gone, or when nothing was renewed for a
    lease past ``valid_until`` (a standby can lead by then). Between the two, the
    leader is paused (sends nothing) and resumes if a renewal finds the key still its
    own: nobody else can have led meanwhile, as the key never went away."""

    def __init__(self, candidate: Candidate, margin_s: float | None = None) -> None:
        self.candidate = candidate
        self.ttl = float(candidate.ttl_s)
        self.margin_s = margin_s if margin_s is not None else max(0.1, self.ttl / 10)
        self.valid_until = 0.0
        self.lost = threading.Event()
        self.why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def valid(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.valid_until

    def wait_valid(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) until ``valid`` or ``lost``; whether valid."""
        deadline = time.monotonic() + timeout
        while not self.valid():
            if self.lost.is_set() or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            self.why = why
            self.lost.set()

    def renew_once(self) -> bool:
        """One renewal (keep-alive, then check the key is ours); moves ``valid_until``."""
        c = self.candidate
        t = time.monotonic()
        timeout = max(0.2, self.ttl / 4)
        try:
            out = c.etcd.call("lease/keepalive", {"ID": c.lease_id}, timeout=timeout)
            result = out.get("result") or {}
            assert isinstance(result, dict)
            ttl = int(result.get("TTL", 0))
            if ttl <= 0:
                self._lose("the lease expired")
                return False
            kvs = c.etcd.call("kv/range", {"key": _b64(c.leader_key)}, timeout=timeout).get("kvs")
            if not kvs or int(kvs[0].get("create_revision", 0)) != c.token:  # type: ignore[index]
                self._lose("another orchestrator holds the leader key")
                return False
        except EtcdUnavailableError:
            return False  # try again; ``valid`` runs out on its own
        self.valid_until = max(self.valid_until, t + min(ttl, self.ttl) - self.margin_s)
        return True

    def start(self) -> bool:
        """Renew once now; start the thread. ``False``: not leading after all."""
        if not self.renew_once():
            self._lose(self.why or "etcd unreachable at the first renewal")
            return False
        self._thread = threading.Thread(target=self._run, name="mcd-lease", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 4) and not self.lost.is_set():
            if not self.renew_once() and time.monotonic() > self.valid_until + self.ttl:
                self._lose(f"the lease was not renewed for {self.ttl:.0f} s past its end")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class LeaderService(OrchestratorService):
    """``OrchestratorService`` on an ``EtcdJournal``, whose frames leave only while
    ``lease`` is valid (module docstring). ``config.journal`` must be None."""

    def __init__(self, config: ServiceConfig, journal: EtcdJournal, lease: LeaseKeeper) -> None:
        super().__init__(config, clock=WallClock())
        self._etcd_journal = journal
        journal.lost = lease.lost.is_set
        self.lease = lease
        #: frames held back because the lease was no longer surely ours
        self.fenced_frames = 0
        self._met: set[bytes] = set()

    def _journal(self) -> EventLog:
        """The etcd journal, read to its end (recovery resumes the core's time at its
        last event: the takeover is not silence of the workers)."""
        j = self._etcd_journal
        try:
            j.follow()
        except EtcdUnavailableError as e:
            raise JournalError(f"journal {j.path}: etcd unreachable: {e}") from e
        return j

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        """As the service's; and the first frame of a worker to this leader (it has just
        found it through etcd) gets, at once, every item it is owed: sent before it
        connected, they went nowhere. (A worker drops copies of what it runs.)"""
        super()._on_frame(ident, frame)
        if ident in self._met:
            return
        self._met.add(ident)
        # everything owed to it, whatever it runs and however recently sent
        for frame in self._sent.due(ident.decode(errors="replace"), set(), time.monotonic(), 0.0):
            self._send_frame(ident, frame)

    def _push_frame(self, ident: bytes, frame: bytes) -> None:
        if not self.lease.valid() and not self.lease.wait_valid(self.lease.ttl):
            self.fenced_frames += 1
            self._counters["fenced_frames"] += 1
            if self.failure is None:
                self._journal_failed(JournalError(f"stopped leading: {self.lease.why}"))
            return
        super()._push_frame(ident, frame)


@dataclass(frozen=True)
class HaOptions:
    """One candidate: ``endpoints`` of etcd, the key ``prefix``, its ``name`` (default:
    the host name), the lease in whole seconds (etcd 3.4's minimum is 2)."""

    endpoints: list[str]
    prefix: str = DEFAULT_PREFIX
    name: str = field(default_factory=socket.gethostname)
    lease_s: int = 2


def serve(
    opts: HaOptions,
    config: ServiceConfig,
    make_api: Callable[[OrchestratorService], Any],
    stop: threading.Event,
    say: Callable[[str], None] = print,
) -> int:
    """Stand by, lead when elected, stand by again when deposed, until ``stop``.
    ``make_api(service)`` starts the HTTP API of a leading service (an object with
    ``url`` and ``close()``). Prints ``orchestrator standby`` / ``orchestrator
    leading: term T ...`` / ``orchestrator deposed`` lines. Returns 0."""
    etcd = EtcdClient(opts.endpoints)
    prefix = opts.prefix.rstrip("/")
    while not stop.is_set():
        cand = Candidate(etcd, prefix, opts.name, ttl_s=opts.lease_s)
        journal = EtcdJournal(cand)
        say(f"orchestrator standby: {opts.name} on etcd {','.join(opts.endpoints)} {prefix}")
        if not _campaign(cand, journal, stop):
            cand.resign()
            break
        why = _lead(cand, journal, config, make_api, stop, say)
        cand.resign()  # our lease (and key, if still ours) goes now, not at its TTL
        if stop.is_set():
            break
        say(f"orchestrator deposed: {opts.name}: {why}; standing by again")
    return 0


def _campaign(cand: Candidate, journal: EtcdJournal, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            cand.campaign(timeout=0.5)
            return True
        except TimeoutError:
            pass
        try:
            journal.follow()
        except (EtcdUnavailableError, JournalError) as e:
            log.info("orchestrator: standby cannot follow the journal now: %s", e)
    return False


def _lead(
    cand: Candidate,
    journal: EtcdJournal,
    config: ServiceConfig,
    make_api: Callable[[OrchestratorService], Any],
    stop: threading.Event,
    say: Callable[[str], None],
) -> str:
    """Serve while leading; returns why it stopped."""
    won = time.monotonic()
    lease = LeaseKeeper(cand)
    if not lease.start():
        return lease.why
    service = LeaderService(config, journal, lease)
    api = None
    try:
        service.start()  # replays the journal
        api = make_api(service)
        ann = Announcement(cand.name, cand.token, service.worker_address, api.url)
        if not cand.announce(msgspec.json.encode(ann)):
            return "lost the lease before announcing"
        say(
            f"orchestrator leading: term {cand.token} api {api.url} "
            f"workers {service.worker_address} events replayed {len(journal._followed)} "
            f"in {time.monotonic() - won:.3f} s from winning the election"
        )
        while not stop.wait(0.05):
            if lease.lost.is_set():
                return lease.why
            if service.stopped.is_set():
                return f"the service stopped: {service.failure}"
        return "stopped"
    except JournalError as e:
        return f"could not recover the journal: {e}"
    finally:
        service.close()
        if api is not None:
            api.close()
        lease.stop()


@dataclass
class Audit:
    """What the journal in etcd says happened (``audit``): each request's completions
    (more than one would be a duplicate), and every dispatched ``(request, stage,
    attempt)``: a worker that ran an item not in it acted on a deposed leader."""

    events: int = 0
    submitted: set[str] = field(default_factory=set)
    completions: dict[str, int] = field(default_factory=dict)
    dispatched: set[tuple[str, str, int]] = field(default_factory=set)
    #: workers the core gave up on (no heartbeat in time), in order
    removed: list[str] = field(default_factory=list)

    def saw(self, event: Event, actions: list[Action]) -> None:
        self.events += 1
        if isinstance(event, Submit) and not any(isinstance(a, Rejected) for a in actions):
            self.submitted.add(event.request_id)
        for a in actions:
            if isinstance(a, RequestCompleted):
                self.completions[a.request_id] = self.completions.get(a.request_id, 0) + 1
            elif isinstance(a, Dispatch):
                self.dispatched.add((a.item.request_id, a.item.stage, a.item.attempt))
            elif isinstance(a, WorkerRemoved) and a.reason.startswith("no heartbeat"):
                self.removed.append(a.worker_id)


def audit(endpoints: list[str], prefix: str = DEFAULT_PREFIX) -> Audit:
    """Replay the group's journal into a fresh core (the config it was written under,
    from ``<prefix>/config``), as a new leader would, and tell what it decided."""
    etcd = EtcdClient(endpoints)
    prefix = prefix.rstrip("/")
    raw = etcd.get(f"{prefix}/config")
    if raw is None:
        raise JournalError(f"no orchestrator journal under {prefix}")
    config = msgspec.json.decode(raw, type=OrchestratorConfig)
    out = Audit()
    journal = EtcdJournal(Candidate(etcd, prefix, "audit"))
    JournaledOrchestrator.recover(journal, config, clock=WallClock(), observer=out.saw)
    return out

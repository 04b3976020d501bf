"""The orchestrator's journal: what is written, recovery after a crash, bad files."""

from __future__ import annotations

import gc
import sqlite3
import threading
import time
from pathlib import Path

import msgspec
import pytest
from orch_harness import Harness, one, only

from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.orchestrator import (
    JOURNAL_SCHEMA_VERSION,
    Cancel,
    Dispatch,
    Drain,
    Heartbeat,
    ItemDone,
    ItemYielded,
    Journal,
    JournaledOrchestrator,
    JournalError,
    LoadStages,
    OrchestratorConfig,
    OrchestratorError,
    PolicyContractError,
    Preempt,
    Reassign,
    RegisterWorker,
    Rejected,
    RequestCompleted,
    Requeued,
    Submit,
    Tick,
    VirtualClock,
    WorkerLost,
    WorkerRemoved,
    create_policy,
)
from mooncake_diffusion.orchestrator.service.journal import CHECKPOINT_EVERY, WAL_FALLBACK_PAGES

pytestmark = pytest.mark.unit

CONFIG = OrchestratorConfig(heartbeat_timeout=10.0)


def journaled(path: Path, clock: VirtualClock | None = None) -> Harness:
    """A harness (invariants checked after every event) whose core is journaled."""
    h = Harness(CONFIG)
    if clock is not None:
        h.clock = clock
    h.core = JournaledOrchestrator.open(  # type: ignore[assignment]
        path, CONFIG, clock=h.clock, policy=create_policy("least_loaded")
    )
    return h


def recover(path: Path, clock: VirtualClock) -> JournaledOrchestrator:
    return JournaledOrchestrator.open(
        path, CONFIG, clock=clock, policy=create_policy("least_loaded")
    )


def cluster(h: Harness) -> None:
    h.worker("enc-0", "encode", 2, node="n0")
    h.worker("den-0", "denoise", 1, node="n0")
    h.worker("den-1", "denoise", 1, node="n1")
    h.worker("dec-0", "decode", 2, node="n0")


def workload(h: Harness) -> set[str]:
    """Submits, dones, a worker death, a cancel and some rejected events; returns the
    ids of the accepted requests. Ends with an accepted event, mid-flight."""
    cluster(h)
    accepted = set()
    for i in range(6):
        h.clock.advance(0.5)
        if not only(h.feed(Submit(f"r{i}", params=b"p")), Rejected):
            accepted.add(f"r{i}")
    assert one(h.feed(Submit("r0")), Rejected).code == "duplicate_request"
    for _ in range(3):
        h.clock.advance(1.0)
        h.finish(h.running()[0])
    h.clock.advance(0.5)
    lost = h.feed(WorkerLost("den-1", "SIGKILL"))
    assert one(lost, WorkerRemoved).requeued, lost  # it held a denoise job
    assert one(h.feed(Heartbeat("den-1")), Rejected).code == "unknown_worker"
    h.feed(Cancel("r5"))
    h.clock.advance(1.0)
    h.finish(h.running()[0])
    h.feed(Heartbeat("dec-0"))
    return accepted


def drain_alive(h: Harness) -> None:
    """Finish running items, oldest first, with every live worker heartbeating."""
    while h.core.snapshot().requests:
        h.clock.advance(0.5)
        for w in h.core.snapshot().workers:
            assert not only(h.feed(Heartbeat(w.worker_id)), Rejected)
        running = h.running()
        assert running, ("stuck", h.core.snapshot())
        h.finish(running[0])


def as_sent(dispatches: list[Dispatch] | tuple[Dispatch, ...]) -> list[bytes]:
    return sorted(msgspec.msgpack.encode(d) for d in dispatches)


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("crash", ["close", "unclosed", "dropped"])
def test_recovery_rebuilds_the_exact_state_and_loses_no_accepted_request(tmp_path, crash):
    path = tmp_path / "orch.db"
    h = journaled(path)
    accepted = workload(h)
    before = h.core.snapshot()
    running = h.running()
    assert running and before.requests and h.outcomes  # mid-run: something of each
    last_now = before.now
    jo = h.core
    if crash == "close":
        jo.close()
    elif crash == "dropped":  # no close: the connection is finalized without a commit
        del h.core, jo
        gc.collect()
    # "unclosed": the first connection stays open while another process would recover;
    # the dead writer's lock is gone, as the OS drops it with the process
    if crash == "unclosed":
        jo.journal._release_lock()

    rec = recover(path, VirtualClock())  # a reboot: the clock restarts at 0
    try:
        assert rec.snapshot() == before
        live = {r.request_id for r in rec.snapshot().requests}
        assert live == accepted - set(h.outcomes) and live  # no accepted request lost
        assert set(rec.snapshot().finished) == set(h.outcomes)
        assert as_sent(rec.recovered_dispatches) == as_sent(running)
        assert rec.now() == last_now  # the clock resumes where the journal ended
        acts = rec.handle(Tick())
        assert not only(acts, Rejected) and rec.snapshot().now == last_now
    finally:
        rec.close()
        if crash == "unclosed":
            jo.close()


def test_only_events_that_changed_the_state_are_written(tmp_path):
    path = tmp_path / "orch.db"
    h = journaled(path)
    jo = h.core
    h.worker("den-0", "denoise", 1, node="n0")
    h.worker("dec-0", "decode", 1, node="n0")
    assert len(jo.journal) == 2
    h.feed(Submit("r1", cached_embeddings=b"emb"))
    assert one(h.feed(Submit("r1")), Rejected).code == "duplicate_request"
    assert one(h.feed(Heartbeat("nobody")), Rejected).code == "unknown_worker"
    assert len(jo.journal) == 3  # the rejected ones are not journaled
    # a rejected event that comes after a heartbeat deadline still expires workers:
    # that part is journaled, as a Tick at the same time
    acts = h.feed(Cancel("ghost"), at=11.0)
    assert one(acts, Rejected).code == "unknown_request" and only(acts, WorkerRemoved)
    assert [type(e) for _, _, e in jo.journal.replay()][-1] is Tick
    before = jo.snapshot()
    jo.close()
    with recover(path, VirtualClock(11.0)) as rec:
        assert rec.snapshot() == before
        assert rec.recovered_dispatches == ()  # its only worker died: r1 is queued


def test_an_event_that_cannot_be_journaled_is_rejected_and_never_reaches_the_core(tmp_path):
    with JournaledOrchestrator.open(tmp_path / "orch.db", CONFIG, clock=VirtualClock()) as jo:
        acts = jo.handle(Submit("r1", params="not bytes"))  # type: ignore[arg-type]
        assert one(acts, Rejected).code == "bad_value"
        acts = jo.handle(object())  # type: ignore[arg-type]
        assert one(acts, Rejected).code == "bad_event"
        assert jo.snapshot().requests == () and len(jo.journal) == 0


def test_stage_changes_and_drains_replay_to_the_same_state(tmp_path):
    """Workers of several stages, one changing stage with a job to give back, one
    loading, one re-registered with its new stages, one draining: the journal
    rebuilds each state, each item and each reservation exactly."""
    path = tmp_path / "orch.db"
    h = journaled(path)
    h.feed(RegisterWorker("ed-0", "encode", 2, {"node": "n0"}, None, ("encode", "decode")))
    h.worker("den-0", "denoise", 1, node="n0")
    h.worker("den-1", "denoise", 1, node="n1")
    h.feed(RegisterWorker("all-0", "denoise", 1, {"node": "n2"}, None, ("denoise", "decode")))
    for i in range(5):
        h.clock.advance(0.5)
        h.feed(Submit(f"r{i}", params=b"p", cached_embeddings=b"e" if i % 2 else None))
    p = one(h.feed(Reassign("den-0", ("encode",), "images")), Preempt)
    acts = h.feed(ItemYielded(p.worker_id, p.request_id, p.stage, p.attempt))
    assert one(acts, LoadStages).worker_id == "den-0"
    h.clock.advance(0.5)
    assert not only(h.feed(RegisterWorker("den-0", "encode", 1, {"node": "n0"})), Rejected)
    busy = next(d for d in h.running() if d.worker_id == "den-1")
    q = one(h.feed(Drain("den-1", "SIGTERM")), Preempt)
    assert q.request_id == busy.item.request_id
    h.feed(Reassign("all-0", ("encode", "denoise", "decode"), "flex"))
    h.clock.advance(0.5)
    before = h.core.snapshot()
    states = {w.worker_id: w.state for w in before.workers}
    assert states["den-1"] == "draining" and states["den-0"] == "serving"
    assert states["all-0"] in ("changing", "loading")
    running = h.running()
    h.core.close()
    with recover(path, VirtualClock()) as rec:
        assert rec.snapshot() == before
        assert as_sent(rec.recovered_dispatches) == as_sent(running)


# ----------------------------------------------------------------------------- restart
def test_a_restart_mid_run_completes_every_accepted_request_exactly_once(tmp_path):
    path = tmp_path / "orch.db"
    clock = VirtualClock()
    h1 = journaled(path, clock)
    cluster(h1)
    n = 8
    for i in range(n):
        assert not only(h1.feed(Submit(f"r{i}", params=b"p")), Rejected)
    for _ in range(9):
        clock.advance(0.5)
        h1.finish(h1.running()[0])
    in_flight = h1.running()
    assert {d.worker_id for d in in_flight} == {"enc-0", "den-0", "den-1"}
    assert h1.outcomes  # some requests completed before the crash
    h1.core.close()  # the orchestrator process dies here
    at_crash = clock.now()

    clock.advance(2.0)  # the restart takes 2 s; den-0 survived it, the others did not
    h2 = Harness(CONFIG)
    h2.clock = clock
    rec = recover(path, clock)
    assert rec.now() == at_crash  # resumed: the downtime is not the workers' silence
    h2.core = rec  # type: ignore[assignment]
    assert as_sent(rec.recovered_dispatches) == as_sent(in_flight)
    assert not only(h2.feed(Heartbeat("den-0")), Rejected)  # a survivor makes contact
    h2.dispatched.extend(rec.recovered_dispatches)  # the driver re-sends them
    h2.worker("enc-1", "encode", 2, node="n2")
    h2.worker("den-2", "denoise", 1, node="n2")
    h2.worker("dec-1", "decode", 2, node="n2")
    survivor = next(d for d in in_flight if d.worker_id == "den-0")
    dead = [d for d in in_flight if d.worker_id != "den-0"]
    h2.finish(survivor)  # its result counts: no re-run needed

    acts = h2.advance(CONFIG.heartbeat_timeout / 2)
    for wid in ("den-0", "enc-1", "den-2", "dec-1"):  # the living beat on
        assert not only(h2.feed(Heartbeat(wid)), Rejected)
    acts += h2.advance(CONFIG.heartbeat_timeout / 2 + 0.5)  # only the dead miss theirs
    removed = {a.worker_id for a in only(acts, WorkerRemoved)}
    assert removed == {"enc-0", "den-1", "dec-0"}
    requeued = {(a.request_id, a.stage, a.attempt) for a in only(acts, Requeued)}
    # every item in flight on a dead worker at the crash is re-queued (and anything
    # dispatched to one since, before its deadline passed)
    assert {(d.item.request_id, d.item.stage, d.item.attempt) for d in dead} <= requeued
    for d in dead:  # a dead worker's late result is a duplicate: dropped by attempt
        late = ItemDone(d.worker_id, d.item.request_id, d.item.stage, d.item.attempt, b"x")
        assert one(h2.feed(late), Rejected).code in ("stale_attempt", "unknown_worker")

    drain_alive(h2)
    redone = {(a.item.request_id, a.item.stage) for a in h2.dispatched if a.item.attempt == 2}
    assert {(d.item.request_id, d.item.stage) for d in dead} <= redone  # at least once
    first, second = set(h1.outcomes), set(h2.outcomes)
    assert not first & second  # no completion surfaced twice across the restart
    assert first | second == {f"r{i}" for i in range(n)}  # and none lost
    assert all(isinstance(a, RequestCompleted) for a in [*h1.outcomes.values()])
    assert all(isinstance(a, RequestCompleted) for a in [*h2.outcomes.values()])
    rec.close()


# ----------------------------------------------------------------------------- bad input
def make_journal(path: Path) -> None:
    with JournaledOrchestrator.open(path, CONFIG, clock=VirtualClock()) as jo:
        jo.handle(Submit("r1"))
        jo.handle(Submit("r2"))
        jo.handle(Submit("r3"))


def test_an_unknown_schema_version_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "orch.db"
    make_journal(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    db.close()
    with pytest.raises(JournalError, match=f"schema version '99'.*{JOURNAL_SCHEMA_VERSION}"):
        recover(path, VirtualClock())


def test_a_corrupt_event_is_refused_naming_its_seq(tmp_path):
    path = tmp_path / "orch.db"
    make_journal(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE events SET event = x'c1ff00' WHERE seq = 2")
    db.close()
    with pytest.raises(JournalError, match="seq 2 is corrupt"):
        recover(path, VirtualClock())


def test_time_going_back_in_the_journal_is_refused_naming_its_seq(tmp_path):
    path = tmp_path / "orch.db"
    make_journal(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE events SET now = 5.0 WHERE seq = 1")
    db.close()
    with pytest.raises(JournalError, match="seq 2 does not replay"):
        recover(path, VirtualClock())


def test_other_files_and_another_config_are_refused(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(JournalError, match="not a readable SQLite journal"):
        Journal(junk)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    db.close()
    with pytest.raises(JournalError, match="not an orchestrator journal"):
        Journal(other)
    path = tmp_path / "orch.db"
    make_journal(path)
    with pytest.raises(JournalError, match="another OrchestratorConfig"):
        JournaledOrchestrator.open(path, OrchestratorConfig(max_attempts=5), clock=VirtualClock())
    assert issubclass(JournalError, OrchestratorError)
    assert issubclass(JournalError, MooncakeDiffusionError)


def test_a_failed_write_returns_no_actions_and_stops_the_orchestrator(tmp_path):
    path = tmp_path / "orch.db"
    jo = JournaledOrchestrator.open(path, CONFIG, clock=VirtualClock())
    jo.handle(Submit("r1"))
    jo.journal.close()  # the next write fails
    with pytest.raises(JournalError, match="write failed"):
        jo.handle(Submit("r2"))
    with pytest.raises(JournalError, match="unusable"):
        jo.handle(Tick())
    with recover(path, VirtualClock()) as rec:  # r2 was never acknowledged, so not lost
        assert [r.request_id for r in rec.snapshot().requests] == ["r1"]


class FailsOnce:
    """Least loaded, but raises on its first call: a deterministic policy bug."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = create_policy("least_loaded")

    def choose(self, item, candidates):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("bug")
        return self.inner.choose(item, candidates)


def test_an_event_that_hit_a_policy_error_is_journaled_and_replays(tmp_path):
    path = tmp_path / "orch.db"
    clock = VirtualClock()
    jo = JournaledOrchestrator.open(path, CONFIG, clock=clock, policy=FailsOnce())
    jo.handle(RegisterWorker("dec-0", "decode", 1))
    jo.handle(RegisterWorker("den-0", "denoise", 1))
    with pytest.raises(PolicyContractError):
        jo.handle(Submit("r1", cached_embeddings=b"emb"))  # the request is accepted anyway
    clock.advance(1.0)
    assert one(jo.handle(Tick()), Dispatch).item.request_id == "r1"
    before = jo.snapshot()
    jo.close()
    with JournaledOrchestrator.open(path, CONFIG, clock=clock, policy=FailsOnce()) as rec:
        assert rec.snapshot() == before
        assert [d.item.request_id for d in rec.recovered_dispatches] == ["r1"]


def test_a_second_writer_is_refused_while_the_first_holds_the_journal(tmp_path):
    path = tmp_path / "orch.db"
    first = Journal(path)
    with pytest.raises(JournalError, match="in use by another orchestrator"):
        Journal(path)
    first.close()
    second = Journal(path)  # free again once the writer is gone
    assert len(second) == 0
    second.close()


def _checkpointers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "journal-checkpoint"]


def test_checkpoints_run_on_a_thread_of_their_own_that_stops_with_the_journal(tmp_path):
    """The log is copied into the database file by the checkpointer thread (started
    by the first write), not by the commit: the writer's own checkpoint waits for
    WAL_FALLBACK_PAGES. Real SQLite; the wait below is for a pass, not a timing."""
    path = tmp_path / "orch.db"
    journal = Journal(path)
    assert _checkpointers() == []  # nothing written yet: no thread
    pages = journal._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
    assert pages == WAL_FALLBACK_PAGES
    before = path.stat().st_size
    journal.begin()
    for i in range(400):
        journal.append(float(i), msgspec.msgpack.encode(Tick()) + bytes(200))
    journal.commit()
    assert len(_checkpointers()) == 1
    deadline = time.monotonic() + 60.0  # generous: a pass every CHECKPOINT_EVERY
    while path.stat().st_size <= before and time.monotonic() < deadline:
        time.sleep(CHECKPOINT_EVERY)
    assert path.stat().st_size > before, "the checkpointer never copied the log"
    journal.close()
    assert _checkpointers() == []
    again = Journal(path)  # and what it copied reads back whole
    assert len(again) == 400
    again.close()

"""Group commit (``JournaledOrchestrator.group``): the events of one block are one
transaction; nothing of it is durable before the block exits, all of it after."""

from __future__ import annotations

import sqlite3

import pytest

from mooncake_diffusion.orchestrator import (
    Dispatch,
    JournaledOrchestrator,
    JournalError,
    OrchestratorConfig,
    RegisterWorker,
    Submit,
    VirtualClock,
)

pytestmark = pytest.mark.unit

CONFIG = OrchestratorConfig(heartbeat_timeout=10.0)


def durable(path) -> int:
    """Events another reader of the file sees (only committed ones, in WAL mode)."""
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        db.close()


def test_a_group_is_one_transaction_and_replays_like_events_one_by_one(tmp_path):
    path = tmp_path / "orch.db"
    clock = VirtualClock()
    with JournaledOrchestrator.open(path, CONFIG, clock=clock) as jo:
        jo.handle(RegisterWorker("enc-0", "encode", 2))
        assert durable(path) == 1
        with jo.group():
            a = jo.handle(Submit("r1"))
            b = jo.handle(Submit("r2"))
            assert durable(path) == 1  # nothing of the group yet
        assert durable(path) == 3
        assert [type(x) for x in a + b] == [Dispatch, Dispatch]
        before = jo.snapshot()
    with JournaledOrchestrator.open(path, CONFIG, clock=clock) as rec:
        assert rec.snapshot() == before
        assert sorted(d.item.request_id for d in rec.recovered_dispatches) == ["r1", "r2"]


def test_another_exception_in_a_group_still_commits_what_the_core_applied(tmp_path):
    path = tmp_path / "orch.db"
    with JournaledOrchestrator.open(path, CONFIG, clock=VirtualClock()) as jo:
        with pytest.raises(RuntimeError), jo.group():
            jo.handle(Submit("r1"))
            raise RuntimeError("a driver bug after the event")
        assert durable(path) == 1  # the journal still matches the core
        jo.handle(Submit("r2"))
        assert durable(path) == 2


def test_a_failed_write_makes_nothing_of_the_group_durable(tmp_path):
    path = tmp_path / "orch.db"
    jo = JournaledOrchestrator.open(path, CONFIG, clock=VirtualClock())
    jo.handle(Submit("r0"))
    with pytest.raises(JournalError, match="write failed"), jo.group():
        jo.handle(Submit("r1"))
        jo.journal.close()  # the next write fails; the open transaction is lost with it
        jo.handle(Submit("r2"))
    assert jo.broken is not None
    with pytest.raises(JournalError, match="unusable"), jo.group():
        pass
    with JournaledOrchestrator.open(path, CONFIG, clock=VirtualClock()) as rec:
        assert [r.request_id for r in rec.snapshot().requests] == ["r0"]

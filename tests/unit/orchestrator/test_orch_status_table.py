"""The service's request table keeps finished statuses out of the collector's walk.

A busy service keeps up to ``max_finished`` finished statuses for the API, each
with its events; as objects they were most of what a full garbage collection
walked. They are kept encoded and decoded at each read.
"""

from __future__ import annotations

import gc

import pytest

from mooncake_diffusion.orchestrator.core.model import (
    Dispatch,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    WorkItem,
)
from mooncake_diffusion.orchestrator.link.wire import ItemRef
from mooncake_diffusion.orchestrator.service.status import RequestTable

pytestmark = pytest.mark.unit

STAGES = ("encode", "denoise", "decode")


def run_through(table: RequestTable, rid: str, end: object) -> None:
    """Submit ``rid``, run its three stages on ``w-1`` with worker info, then ``end``."""
    table.submitted(rid, "interactive")
    for stage in STAGES:
        item = WorkItem(rid, stage, 1, "interactive", 9.0, b"p", b"", {})
        table.apply(Dispatch("w-1", item))
        table.done(ItemRef(rid, stage, 1), "w-1", {"gpu_ms": 12.5, "host": "n0"})
    table.apply(end)  # type: ignore[arg-type]


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_finished_statuses_cost_the_collector_nothing_and_read_back_whole():
    table = RequestTable(max_finished=2_000)
    run_through(table, "warm", RequestCompleted("warm", b"out", 1.0, 2.0, 3.0))
    before = tracked()
    for i in range(1_000):
        run_through(table, f"r-{i}", RequestCompleted(f"r-{i}", b"out", 1.0, 2.0, 3.0))
    # as objects they were 11 tracked each here (the status, its lists, its events)
    assert tracked() - before < 100

    st = table.status("r-7")
    assert st is not None and st.state == "completed" and st.output == b"out"
    assert st.deadline_met is True and st.finished_at is not None and st.worker_id is None
    kinds = [e.kind for e in st.events]
    assert kinds == ["submitted"] + ["dispatched", "done"] * 3 + ["completed"]
    assert st.events[2].info == {"gpu_ms": 12.5, "host": "n0"} and st.events[1].worker_id == "w-1"
    st.events.clear()  # a reader's copy: the table's is untouched
    assert len(table.status("r-7").events) == len(kinds)
    assert [s.request_id for s in table.recent(2)] == ["r-998", "r-999"]


def test_failed_and_cancelled_keep_their_reasons_and_the_oldest_are_dropped():
    table = RequestTable(max_finished=2)
    run_through(table, "f", RequestFailed("f", ("oom on w-1", "oom on w-2")))
    run_through(table, "c", RequestCancelled("c", "by client"))
    assert table.status("f").reasons == ["oom on w-1", "oom on w-2"]
    assert table.status("f").deadline_met is None
    assert table.status("c").reasons == ["by client"] and table.status("c").state == "cancelled"
    run_through(table, "x", RequestCompleted("x", b"o", 1.0, 5.0, 3.0))
    assert table.status("f") is None and table.status("x").deadline_met is False


def test_a_status_copy_is_the_readers_own_live_or_finished():
    table = RequestTable()
    table.submitted("live", "batch")
    copy = table.status_copy("live")
    copy.events.clear()
    copy.reasons.append("mine")
    assert len(table.status("live").events) == 1 and table.status("live").reasons == []
    run_through(table, "done", RequestCompleted("done", b"o", 1.0, 2.0, 3.0))
    assert table.status_copy("done") == table.status("done") and table.status_copy("x") is None

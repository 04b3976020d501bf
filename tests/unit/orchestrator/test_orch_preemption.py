"""Step-boundary preemption: a waiting interactive denoise job makes a running batch job
yield; the batch job resumes later, and a yield is never a failed attempt."""

from __future__ import annotations

import pytest
from orch_harness import Harness, one, only

from mooncake_diffusion.orchestrator import (
    Dispatch,
    ItemFailed,
    ItemYielded,
    OrchestratorConfig,
    Preempt,
    Rejected,
    RequestCompleted,
    Submit,
)

pytestmark = pytest.mark.unit


def harness(**cfg: object) -> Harness:
    h = Harness(OrchestratorConfig(heartbeat_timeout=1e6, preemption=True, **cfg))  # type: ignore[arg-type]
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 4)
    return h


def yield_of(p: Preempt) -> ItemYielded:
    return ItemYielded(p.worker_id, p.request_id, p.stage, p.attempt)


def test_interactive_job_preempts_batch_job_which_resumes_after_it():
    h = harness()
    b = one(h.feed(Submit("b", "batch", cached_embeddings=b"e"), at=0.0), Dispatch)
    acts = h.feed(Submit("i", "interactive", cached_embeddings=b"e"), at=1.0)
    p = one(acts, Preempt)
    assert (p.worker_id, p.request_id, p.attempt) == ("den-0", "b", b.item.attempt)
    assert not only(acts, Dispatch)  # the credit stays held until the worker yields
    # a second interactive job: the only victim is already preempting, no second Preempt
    assert not only(h.feed(Submit("i2", "interactive", cached_embeddings=b"e")), Preempt)
    acts = h.feed(yield_of(p), at=2.0)
    d = one(acts, Dispatch)
    assert (d.worker_id, d.item.request_id, d.item.stage) == ("den-0", "i", "denoise")
    h.drain()
    order = [rid for rid, a in h.outcomes.items() if isinstance(a, RequestCompleted)]
    assert order.index("i") < order.index("b") and order.index("i2") < order.index("b")
    resumed = [x for x in h.dispatched if x.item.request_id == "b" and x.item.stage == "denoise"]
    assert [x.item.attempt for x in resumed] == [1, 2]  # a new attempt number, same input
    assert resumed[1].item.input == resumed[0].item.input


def test_one_preempt_per_waiting_job_and_none_without_a_higher_class():
    h = harness()
    h.feed(Submit("b1", "batch", cached_embeddings=b"e"), at=0.0)
    assert not only(h.feed(Submit("b2", "batch", cached_embeddings=b"e")), Preempt)
    p = one(h.feed(Submit("i1", "interactive", cached_embeddings=b"e")), Preempt)
    assert p.request_id == "b1"
    # a second interactive job finds the only victim already preempting: no new Preempt
    assert not only(h.feed(Submit("i2", "interactive", cached_embeddings=b"e")), Preempt)


def test_yields_do_not_use_up_attempts_and_preemption_is_bounded():
    h = harness(max_attempts=1, max_preemptions=2)
    h.feed(Submit("b", "batch", cached_embeddings=b"e"), at=0.0)
    for n in range(2):
        p = one(h.feed(Submit(f"i{n}", "interactive", cached_embeddings=b"e")), Preempt)
        d = one(h.feed(yield_of(p)), Dispatch)
        assert d.item.request_id == f"i{n}"
        h.finish(d)  # i's denoise done; b is admitted again (its decode is elsewhere)
        back = [x for x in h.running() if x.item.request_id == "b"]
        assert len(back) == 1
    # b has yielded max_preemptions times: a third interactive job waits instead
    assert not only(h.feed(Submit("i2", "interactive", cached_embeddings=b"e")), Preempt)
    h.drain()
    assert isinstance(h.outcomes["b"], RequestCompleted)  # max_attempts=1 and still done


def test_an_unasked_yield_is_rejected_and_a_finished_job_needs_no_yield():
    h = harness()
    b = one(h.feed(Submit("b", "batch", cached_embeddings=b"e"), at=0.0), Dispatch)
    r = one(h.feed(ItemYielded("den-0", "b", "denoise", b.item.attempt)), Rejected)
    assert r.code == "bad_value"
    p = one(h.feed(Submit("i", "interactive", cached_embeddings=b"e")), Preempt)
    acts = h.finish(b)  # b finished before it saw the Preempt: its Done counts
    assert {(d.item.request_id, d.item.stage) for d in only(acts, Dispatch)} == {
        ("b", "decode"),
        ("i", "denoise"),
    }
    stale = h.feed(yield_of(p))  # the late yield of a finished attempt
    assert one(stale, Rejected).code == "stale_attempt"
    h.drain()
    assert set(h.outcomes) == {"b", "i"}


def test_a_preempting_job_whose_worker_fails_it_is_an_ordinary_attempt():
    h = harness(max_attempts=2)
    b = one(h.feed(Submit("b", "batch", cached_embeddings=b"e"), at=0.0), Dispatch)
    one(h.feed(Submit("i", "interactive", cached_embeddings=b"e")), Preempt)
    acts = h.feed(ItemFailed("den-0", "b", "denoise", b.item.attempt, "boom"))
    assert one(acts, Dispatch).item.request_id == "i"
    h.drain()
    assert set(h.outcomes) == {"b", "i"}


def test_off_by_default():
    h = Harness(OrchestratorConfig(heartbeat_timeout=1e6))
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 4)
    h.feed(Submit("b", "batch", cached_embeddings=b"e"))
    assert not only(h.feed(Submit("i", "interactive", cached_embeddings=b"e")), Preempt)

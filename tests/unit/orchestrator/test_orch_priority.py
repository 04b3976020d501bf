"""Priority and SLO classes: interactive passes batch, and batch waits are bounded."""

from __future__ import annotations

import random

import pytest
from orch_harness import Harness, one, only

from mooncake_diffusion.orchestrator import (
    Dispatch,
    Heartbeat,
    OrchestratorConfig,
    RegisterWorker,
    RequestCompleted,
    SloClass,
    Submit,
)
from mooncake_diffusion.orchestrator.core.queues import ClassQueue

pytestmark = pytest.mark.unit


def classes(max_wait: float | None) -> tuple[SloClass, ...]:
    return (
        SloClass("interactive", priority=0, deadline=30.0),
        SloClass("batch", priority=1, deadline=3600.0, max_wait=max_wait),
    )


def two_latents_waiting(max_wait: float | None) -> Harness:
    """A batch latent (ready at t=2) and an interactive one (t=3) wait at a stalled decode pool."""
    h = Harness(OrchestratorConfig(classes=classes(max_wait), heartbeat_timeout=1e6))
    h.worker("den-0", "denoise", 1)
    h.worker("den-1", "denoise", 1)
    h.worker("dec-0", "decode", 2)
    b = one(h.feed(Submit("b", "batch", cached_embeddings=b"e"), at=0.0), Dispatch)
    i = one(h.feed(Submit("i", "interactive", cached_embeddings=b"e"), at=1.0), Dispatch)
    h.feed(Heartbeat("dec-0", credits=0))
    h.clock.set(2.0)
    assert only(h.finish(b, b"lat-b"), Dispatch) == []
    h.clock.set(3.0)
    assert only(h.finish(i, b"lat-i"), Dispatch) == []
    assert h.core.snapshot().queued["decode"] == ("b", "i")
    return h


def test_interactive_passes_batch_at_the_decode_queue():
    h = two_latents_waiting(max_wait=60.0)
    first = one(h.feed(Heartbeat("dec-0", credits=1), at=4.0), Dispatch)
    assert (first.item.request_id, first.item.input) == ("i", b"lat-i")  # queued later, goes first
    assert h.core.snapshot().queued["decode"] == ("b",)
    h.clock.set(5.0)
    assert one(h.finish(first), Dispatch).item.request_id == "b"


def test_an_overdue_batch_item_goes_first_at_the_decode_queue():
    h = two_latents_waiting(max_wait=5.0)
    first = one(h.feed(Heartbeat("dec-0", credits=1), at=7.0), Dispatch)  # b waited 5 s
    assert first.item.request_id == "b"


def test_interactive_is_admitted_before_batch_at_denoise():
    h = Harness(OrchestratorConfig(classes=classes(60.0), heartbeat_timeout=1e6))
    h.worker("dec-0", "decode", 4)
    for i, cls in enumerate(["batch", "batch", "interactive", "batch", "interactive"]):
        h.feed(Submit(f"r{i}-{cls}", cls, cached_embeddings=b"e"), at=float(i))
    h.feed(RegisterWorker("den-0", "denoise", 4), at=10.0)
    order = [d.item.request_id for d in h.dispatched]
    assert order == ["r2-interactive", "r4-interactive", "r0-batch", "r1-batch"]


SERVICE = 2.0
MAX_WAIT = 10.0


def flood(stage: str, max_wait: float | None, horizon: float) -> float | None:
    """One worker at ``stage`` serves items in SERVICE s each while at least three
    interactive requests always wait there; a batch request arrives at t=0.5.
    Returns when the batch item was dispatched at ``stage`` (None: not by ``horizon``)."""
    h = Harness(OrchestratorConfig(classes=classes(max_wait), heartbeat_timeout=1e6))
    cached = None if stage == "encode" else b"emb"
    h.worker("enc-0", "encode", 1 if stage == "encode" else 100)
    h.worker("den-0", "denoise", 1 if stage == "denoise" else 100)
    h.worker("dec-0", "decode", 100)
    n = 0

    def top_up() -> None:
        nonlocal n
        while sum(1 for r in h.core.snapshot().requests if r.stage == stage) < 4:
            h.feed(Submit(f"i{n}", "interactive", cached_embeddings=cached))
            n += 1

    top_up()
    h.feed(Submit("B", "batch", cached_embeddings=cached), at=0.5)
    t = 0.5
    while t < horizon:
        top_up()
        (busy,) = [d for d in h.running() if d.item.stage == stage]
        if busy.item.request_id == "B":
            return t
        t = h.clock.now() + SERVICE - (h.clock.now() % SERVICE)
        h.clock.set(t)
        h.finish(busy)
    return None


@pytest.mark.parametrize("stage", ["encode", "denoise"])
def test_batch_wait_is_bounded_under_an_interactive_flood(stage):
    started = flood(stage, MAX_WAIT, horizon=20 * MAX_WAIT)
    assert started is not None
    wait = started - 0.5
    assert MAX_WAIT <= wait <= MAX_WAIT + SERVICE  # passed until overdue, then next
    assert flood(stage, None, horizon=20 * MAX_WAIT) is None  # without the bound: starved


# ----------------------------------------------------------------------------- the queue itself
QCLASSES = (
    SloClass("hi", priority=0, deadline=1.0),
    SloClass("mid", priority=1, deadline=1.0, max_wait=3.0),
    SloClass("lo", priority=2, deadline=1.0, max_wait=1.0),
    SloClass("lo2", priority=2, deadline=1.0),
)
BY_NAME = {c.name: c for c in QCLASSES}


def overdue_at(cls: str, since: float, now: float) -> float | None:
    w = BY_NAME[cls].max_wait
    return since + w if w is not None and now - since >= w else None


@pytest.mark.parametrize("seed", range(5))
def test_class_queue_serves_overdue_first_then_priority_then_age(seed):
    rng = random.Random(seed)
    q: ClassQueue[int] = ClassQueue(QCLASSES)
    live: dict[int, tuple[str, float, int]] = {}  # item -> (class, since, push order)
    tokens: dict[int, int] = {}
    now, pushes, pops = 0.0, 0, 0
    for step in range(3000):
        now += rng.uniform(0, 0.4)
        r = rng.random()
        if r < 0.5:
            cls = rng.choice(QCLASSES).name
            since = now - rng.choice([0.0, 0.0, rng.uniform(0, 5)])  # re-queued items are older
            tokens[step] = q.push(step, cls, since)
            live[step] = (cls, since, pushes)
            pushes += 1
        elif r < 0.6 and live:
            victim = rng.choice(sorted(live))
            q.discard(tokens[victim], live[victim][0])
            del live[victim]
        else:
            got = q.pop(now)
            if not live:
                assert got is None
                continue
            assert got in live
            cls, since, order = live.pop(got)
            pops += 1
            mine = overdue_at(cls, since, now)
            others = [(overdue_at(c, s, now), c, s, o) for c, s, o in live.values()]
            overdue = [(t, o) for t, _, _, o in others if t is not None]
            if mine is None:  # only when nothing is overdue; then lowest priority, oldest
                assert not overdue
                key = (BY_NAME[cls].priority, since, order)
                assert all(key < (BY_NAME[c].priority, s, o) for _, c, s, o in others)
            else:  # the bound: nothing waiting became overdue before it did
                assert all((mine, order) < (t, o) for t, o in overdue)
        assert len(q) == len(live)
        for c in QCLASSES:  # the per-class counts the preemption rule reads
            below = sum(BY_NAME[k].priority < c.priority for k, _, _ in live.values())
            assert q.waiting_better_than(c.priority) == below
    assert pops > 500


def test_deadlines_come_from_the_class_or_the_submit_and_are_reported():
    h = Harness(OrchestratorConfig(classes=classes(60.0), heartbeat_timeout=1e6))
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 1)
    d = one(h.feed(Submit("i", "interactive", cached_embeddings=b"e"), at=100.0), Dispatch)
    assert d.item.deadline == 130.0  # submit + the class's 30 s
    h.clock.set(120.0)
    dec = one(h.finish(d), Dispatch)
    assert dec.item.deadline == 130.0
    h.clock.set(131.0)
    done = one(h.finish(dec), RequestCompleted)
    assert (done.submitted_at, done.finished_at, done.deadline) == (100.0, 131.0, 130.0)
    assert not done.deadline_met
    b = one(h.feed(Submit("b", "batch", cached_embeddings=b"e", deadline=500.0)), Dispatch)
    assert b.item.deadline == 500.0 and b.item.slo_class == "batch"

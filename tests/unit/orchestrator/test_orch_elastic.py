"""Elastic pools in the core: workers that hold several stages, stage changes at
runtime (``Reassign`` -> ``LoadStages`` -> register again) and scale-down
(``Drain``), one event at a time under a virtual clock, then on random sequences."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from orch_harness import Harness, one, only

from mooncake_diffusion.orchestrator import (
    STAGES,
    Cancel,
    Dispatch,
    Drain,
    Heartbeat,
    ItemDone,
    ItemFailed,
    ItemYielded,
    JournaledOrchestrator,
    LoadStages,
    OrchestratorConfig,
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

pytestmark = pytest.mark.unit


def worker(h: Harness, wid: str, stages: tuple[str, ...], credits: int = 1, **labels: str):
    acts = h.feed(RegisterWorker(wid, stages[0], credits, dict(labels), None, stages))
    assert not only(acts, Rejected), acts
    return acts


def state(h: Harness, wid: str) -> str:
    return next(w.state for w in h.core.snapshot().workers if w.worker_id == wid)


def yield_of(d: Dispatch | Preempt) -> ItemYielded:
    if isinstance(d, Dispatch):
        return ItemYielded(d.worker_id, d.item.request_id, d.item.stage, d.item.attempt)
    return ItemYielded(d.worker_id, d.request_id, d.stage, d.attempt)


def on(h: Harness, rid: str) -> Dispatch:
    return next(d for d in h.running() if d.item.request_id == rid)


# ----------------------------------------------------------------------------- several stages
def test_a_worker_of_several_stages_takes_each_of_them_with_one_set_of_credits():
    h = Harness(heartbeat_timeout=1e6)
    worker(h, "ed-0", ("encode", "denoise"), 2)
    worker(h, "dec-0", ("decode",), 2)
    snap = {w.worker_id: w for w in h.core.snapshot().workers}
    assert snap["ed-0"].stages == ("encode", "denoise") and snap["ed-0"].stage == "encode"
    free = h.core.snapshot().free_credits
    assert free == {"encode": 2, "denoise": 2, "decode": 2}  # one GPU, counted in each stage
    d1 = one(h.feed(Submit("r1")), Dispatch)
    d2 = one(h.feed(Submit("r2")), Dispatch)
    assert (d1.worker_id, d2.worker_id) == ("ed-0", "ed-0")
    # both credits are held by encode items: denoise has none left either
    assert h.core.snapshot().free_credits["denoise"] == 0
    nxt = one(h.finish(d1), Dispatch)
    assert (nxt.worker_id, nxt.item.stage) == ("ed-0", "denoise")
    h.drain()
    assert all(isinstance(h.outcomes[r], RequestCompleted) for r in ("r1", "r2"))


def test_registration_checks_the_stages():
    h = Harness()
    bad = [
        (RegisterWorker("w", "encode", 1, {}, None, ("denoise",)), "bad_value"),  # not in
        (RegisterWorker("w", "encode", 1, {}, None, ("encode", "encode")), "bad_value"),
        (RegisterWorker("w", "encode", 1, {}, None, ("encode", "upscale")), "unknown_stage"),
    ]
    for ev, code in bad:
        assert one(h.feed(ev), Rejected).code == code
    assert not h.core.snapshot().workers
    worker(h, "w", ("decode", "encode"))  # ``stage`` is the first of ``stages``, as given
    assert h.core.snapshot().workers[0].stages == ("decode", "encode")


@pytest.mark.parametrize("policy", ["affinity", "least_loaded", "round_robin"])
@pytest.mark.parametrize("gpus", [1, 3])
def test_every_worker_holding_every_stage_is_colocated_serving(policy, gpus):
    """One credit per GPU: each request runs encode, denoise and decode on one GPU and
    ``gpus`` requests run at once. A reservation that took the denoise job's own
    credit for its latent would admit one denoise job at a time (or, with one GPU,
    none behind an encode item); one that forgot it would dispatch a decode item
    against a credit already held."""
    h = Harness(OrchestratorConfig(heartbeat_timeout=1e6), create_policy(policy))
    for g in range(gpus):
        worker(h, f"gpu-{g}", STAGES, 1, node=f"n{g}")
    for i in range(gpus):
        h.feed(Submit(f"r{i}"))
    assert len(h.running()) == gpus  # every GPU took a request's encode
    for d in list(h.running()):
        nxt = one(h.finish(d), Dispatch)
        if policy == "affinity":  # the latent stays where it was made, as colocated
            assert nxt.worker_id == d.worker_id
        assert nxt.item.stage == "denoise"
    assert len(h.running()) == gpus  # all denoise jobs at once, nothing reserved
    assert h.core.snapshot().decode_reserved == 0
    for d in list(h.running()):
        nxt = one(h.finish(d), Dispatch)
        assert nxt.item.stage == "decode"
        if policy == "affinity":
            assert nxt.worker_id == d.worker_id
    h.drain()
    assert sorted(h.outcomes) == [f"r{i}" for i in range(gpus)]


def test_a_denoise_only_worker_still_reserves_a_decode_credit_of_a_shared_one():
    """The shared GPU's credit is the only decode credit: a job on the denoise-only GPU
    reserves it, so a second job may not take it for denoise (the latent would wait)."""
    h = Harness(heartbeat_timeout=1e6)
    worker(h, "den-0", ("denoise",), 1)
    worker(h, "all-0", STAGES, 1)
    d = one(h.feed(Submit("r1", cached_embeddings=b"e")), Dispatch)
    assert d.worker_id == "den-0" and h.core.snapshot().decode_reserved == 1
    assert not only(h.feed(Submit("r2", cached_embeddings=b"e")), Dispatch)  # waits
    dec = one(h.finish(d), Dispatch)
    assert (dec.worker_id, dec.item.stage) == ("all-0", "decode")
    h.drain()


# ----------------------------------------------------------------------------- Reassign
def elastic() -> Harness:
    h = Harness(heartbeat_timeout=10.0)  # preemption is off: a stage change preempts anyway
    worker(h, "enc-0", ("encode",), 2)
    worker(h, "den-0", ("denoise",), 1)
    worker(h, "den-1", ("denoise",), 1)
    worker(h, "dec-0", ("decode",), 2)
    return h


def test_a_stage_change_preempts_denoise_which_resumes_elsewhere_then_loads_and_serves():
    h = elastic()
    h.feed(Submit("r1", cached_embeddings=b"e"))
    d = on(h, "r1")
    assert d.worker_id == "den-0"
    acts = h.feed(Reassign("den-0", ("decode",), "mix moved to images"))
    p = one(acts, Preempt)
    assert (p.worker_id, p.request_id, p.attempt) == ("den-0", "r1", 1)
    assert "stage change" in p.reason and not only(acts, LoadStages)
    assert state(h, "den-0") == "changing"
    assert h.core.snapshot().free_credits["denoise"] == 1  # den-1 only
    acts = h.feed(yield_of(p))
    again = one(acts, Dispatch)
    assert (again.worker_id, again.item.attempt) == ("den-1", 2)  # resumed elsewhere
    load = one(acts, LoadStages)
    assert load == LoadStages("den-0", ("decode",), "mix moved to images")
    assert acts.index(load) < acts.index(again)  # settled before the next dispatches
    assert state(h, "den-0") == "loading"
    h.advance(8.0)
    assert not only(h.feed(Heartbeat("den-0")), Rejected)  # loading: alive, no work
    h.advance(8.0)  # den-1 and the others went silent
    assert state(h, "den-0") == "loading"
    acts = h.feed(RegisterWorker("den-0", "decode", 2))  # the same id: not a duplicate
    assert not only(acts, Rejected)
    snap = {w.worker_id: w for w in h.core.snapshot().workers}
    assert snap["den-0"].stages == ("decode",) and snap["den-0"].state == "serving"


def test_the_yielded_attempt_is_not_a_failure_and_a_late_result_is_stale():
    h = Harness(OrchestratorConfig(heartbeat_timeout=1e6, max_attempts=1))
    worker(h, "den-0", ("denoise",), 1)
    worker(h, "den-1", ("denoise",), 1)
    worker(h, "dec-0", ("decode",), 1)
    h.feed(Submit("r1", cached_embeddings=b"e"))
    p = one(h.feed(Reassign("den-0", ("encode",))), Preempt)
    one(h.feed(yield_of(p)), Dispatch)
    r = h.core.snapshot().requests[0]
    assert (r.attempt, r.yields) == (2, 1)  # max_attempts=1 and not failed
    late = ItemDone("den-0", "r1", "denoise", 1, b"late")
    assert one(h.feed(late), Rejected).code == "stale_attempt"
    h.drain()
    assert isinstance(h.outcomes["r1"], RequestCompleted)


def test_encode_and_decode_items_of_a_changing_worker_finish_or_come_back():
    h = Harness(OrchestratorConfig(heartbeat_timeout=1e6, max_attempts=1))
    worker(h, "ed-0", ("encode", "decode"), 2)
    worker(h, "den-0", ("denoise",), 1)
    h.feed(Submit("r1", cached_embeddings=b"e"))
    dec = one(h.finish(on(h, "r1")), Dispatch)
    assert (dec.worker_id, dec.item.stage) == ("ed-0", "decode")
    enc = one(h.feed(Submit("r2")), Dispatch)
    assert enc.worker_id == "ed-0"
    acts = h.feed(Reassign("ed-0", ("denoise",)))
    assert not only(acts, Preempt) and not only(acts, Dispatch)  # no denoise job: no Preempt
    acts = h.finish(dec)  # the decode item finishes
    assert one(acts, RequestCompleted).request_id == "r1" and not only(acts, LoadStages)
    acts = h.feed(yield_of(enc))  # the encode item comes back, not a failed attempt
    assert one(acts, LoadStages).stages == ("denoise",)
    assert not only(acts, Requeued) and not only(acts, Rejected)
    assert h.core.snapshot().queued["encode"] == ("r2",)
    worker(h, "ed-0", ("encode", "decode"), 1)  # its new registration takes the item
    assert on(h, "r2").item.attempt == 2
    h.drain()
    assert isinstance(h.outcomes["r2"], RequestCompleted)


def test_an_unasked_yield_of_a_serving_worker_is_still_refused():
    h = elastic()
    enc = one(h.feed(Submit("r1")), Dispatch)
    assert one(h.feed(yield_of(enc)), Rejected).code == "bad_value"


@pytest.mark.parametrize(
    ("event", "code"),
    [
        (Reassign("ghost", ("decode",)), "unknown_worker"),
        (Reassign("den-0", ()), "bad_value"),
        (Reassign("den-0", ("decode", "decode")), "bad_value"),
        (Reassign("den-0", ("upscale",)), "unknown_stage"),
        (Reassign("den-0", ("denoise",)), "bad_value"),  # it holds that already
        (Drain("ghost"), "unknown_worker"),
    ],
)
def test_bad_reassigns_and_drains_are_rejected_and_change_nothing(event, code):
    h = elastic()
    h.feed(Submit("r1"))
    before = h.core.snapshot()
    assert one(h.feed(event), Rejected).code == code
    assert h.core.snapshot() == before


def test_a_worker_already_leaving_is_not_reassigned_again_nor_registered_twice():
    h = elastic()
    h.feed(Submit("r1", cached_embeddings=b"e"))
    h.feed(Reassign("den-0", ("decode",)))
    assert one(h.feed(Reassign("den-0", ("encode",))), Rejected).code == "not_serving"
    assert one(h.feed(RegisterWorker("den-0", "decode")), Rejected).code == "duplicate_worker"
    acts = h.feed(Drain("den-0"))  # leaving wins over a change; the job was asked once
    assert not only(acts, Rejected) and not only(acts, Preempt)
    assert state(h, "den-0") == "draining"
    assert one(h.feed(Drain("den-0")), Rejected).code == "not_serving"
    assert one(h.feed(Reassign("den-0", ("encode",))), Rejected).code == "not_serving"


def test_nothing_is_dispatched_to_a_changing_worker():
    h = elastic()
    h.feed(Reassign("enc-0", ("decode",)))  # idle: it loads at once
    assert state(h, "enc-0") == "loading"
    assert not only(h.feed(Submit("r1")), Dispatch)  # no encode worker serves
    assert h.core.snapshot().queued["encode"] == ("r1",)


# ----------------------------------------------------------------------------- Drain
def test_a_drain_moves_denoise_through_a_yield_and_removes_the_worker_once_empty():
    h = elastic()
    h.feed(Submit("r1", cached_embeddings=b"e"))
    h.feed(Submit("r2", cached_embeddings=b"e"))
    assert {d.worker_id for d in h.running()} == {"den-0", "den-1"}
    h.feed(Submit("r3", cached_embeddings=b"e"), at=1.0)  # waits for a denoise credit
    p = one(h.feed(Drain("den-0", "SIGTERM, 30 s notice")), Preempt)
    assert "drain" in p.reason
    acts = h.feed(yield_of(p))
    removed = one(acts, WorkerRemoved)
    assert removed == WorkerRemoved("den-0", "SIGTERM, 30 s notice", (), ())
    assert not only(acts, Dispatch)  # den-1 is busy: the yielded job waits, keeping its place
    acts = h.finish(on(h, "r2"))  # den-1's job ends: the moved job goes before r3
    nxt = next(d for d in only(acts, Dispatch) if d.item.stage == "denoise")
    assert (nxt.item.request_id, nxt.worker_id) == ("r1", "den-1")
    assert one(h.feed(Heartbeat("den-0")), Rejected).code == "unknown_worker"
    h.drain()
    assert len(h.outcomes) == 3 and all(
        isinstance(o, RequestCompleted) for o in h.outcomes.values()
    )


def test_an_idle_worker_drains_at_once_and_a_changing_one_may_drain():
    h = elastic()
    assert one(h.feed(Drain("dec-0")), WorkerRemoved).worker_id == "dec-0"
    h.feed(Reassign("enc-0", ("decode",)))
    assert one(h.feed(Drain("enc-0", "spot loss")), WorkerRemoved).reason == "spot loss"


def test_cancel_of_the_last_item_of_a_draining_worker_removes_it():
    h = elastic()
    h.feed(Submit("r1"))
    h.feed(Drain("enc-0"))
    acts = h.feed(Cancel("r1"))
    assert only(acts, WorkerRemoved)[0].worker_id == "enc-0"


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("when", ["changing", "loading", "draining"])
@pytest.mark.parametrize("how", ["lost", "silent"])
def test_a_worker_lost_in_any_state_loses_nothing(when, how):
    h = elastic()
    h.feed(Submit("r1", cached_embeddings=b"e"))
    h.feed(Submit("r2"))
    ev = Drain("den-0") if when == "draining" else Reassign("den-0", ("decode",))
    p = one(h.feed(ev), Preempt)
    if when == "loading":
        h.feed(yield_of(p))
    assert state(h, "den-0") == when
    for w in ("enc-0", "den-1", "dec-0"):
        h.feed(Heartbeat(w), at=9.0)
    # lost, or silent: den-0 misses its deadline; the others heartbeat at 9
    ev = WorkerLost("den-0", "SIGKILL") if how == "lost" else Tick()
    acts = h.feed(ev, at=10.5)
    gone = one(acts, WorkerRemoved)
    assert gone.worker_id == "den-0" and gone.requeued == (() if when == "loading" else ("r1",))
    for w in ("enc-0", "den-1", "dec-0"):
        h.feed(Heartbeat(w))
    h.drain()
    assert sorted(h.outcomes) == ["r1", "r2"]
    assert all(isinstance(o, RequestCompleted) for o in h.outcomes.values())


def test_a_failure_of_a_moving_job_is_an_ordinary_attempt():
    h = elastic()
    h.feed(Submit("r1", cached_embeddings=b"e"))
    p = one(h.feed(Reassign("den-0", ("encode",))), Preempt)
    acts = h.feed(ItemFailed("den-0", "r1", "denoise", p.attempt, "OOM while loading"))
    assert one(acts, Requeued).attempt == 1 and one(acts, LoadStages)


def test_a_stage_change_is_not_counted_against_max_preemptions():
    h = Harness(OrchestratorConfig(heartbeat_timeout=1e6, preemption=True, max_preemptions=0))
    worker(h, "den-0", ("denoise",), 1)
    worker(h, "den-1", ("denoise",), 1)
    worker(h, "dec-0", ("decode",), 4)
    h.feed(Submit("r1", "batch", cached_embeddings=b"e"))
    for n in range(3):  # moved three times, never preempted for priority
        d = on(h, "r1")
        spare = "den-1" if d.worker_id == "den-0" else "den-0"
        p = one(h.feed(Reassign(d.worker_id, ("decode",))), Preempt)
        acts = h.feed(yield_of(p))
        assert one(acts, Dispatch).worker_id == spare
        worker(h, d.worker_id, ("denoise",), 1)
        assert h.core.snapshot().requests[0].yields == n + 1
    h.drain()


# ----------------------------------------------------------------------------- random runs
def _chaos(h: Harness, rng: random.Random, events: int) -> tuple[set[str], Counter[str]]:
    """Workers register (one stage or several), are reassigned, drain, die and come
    back; requests come, finish, fail and are cancelled. Invariants are checked after
    every event (the harness). Returns the accepted request ids and the actions seen."""
    accepted: set[str] = set()
    seen: Counter[str] = Counter()

    def feed(ev: object) -> list:
        acts = h.feed(ev)  # type: ignore[arg-type]
        seen.update(type(a).__name__ for a in acts)
        return acts

    def stages() -> tuple[str, ...]:
        return tuple(rng.sample(STAGES, rng.randrange(1, 4)))

    for n in range(events):
        h.clock.advance(rng.choice([0.0, 0.1, 1.0]))
        snap = h.core.snapshot()
        workers = snap.workers
        running = [(w, rid) for w in workers for rid in w.running]
        roll = rng.random()
        if roll < 0.06 or len(workers) < 2:
            s = stages()
            feed(RegisterWorker(f"w{n}", s[0], rng.randrange(1, 4), {"node": f"n{n % 3}"}, None, s))
        elif roll < 0.3:
            emb = rng.choice([None, b"e"])
            if not only(feed(Submit(f"r{n}", cached_embeddings=emb)), Rejected):
                accepted.add(f"r{n}")
        elif roll < 0.36:
            feed(Reassign(rng.choice(workers).worker_id, stages(), "planner"))
        elif roll < 0.39 and len(workers) > 3:
            feed(Drain(rng.choice(workers).worker_id, "scale-down"))
        elif roll < 0.41 and len(workers) > 3:
            feed(WorkerLost(rng.choice(workers).worker_id, "spot loss"))
        elif roll < 0.5 and (loading := [w for w in workers if w.state == "loading"]):
            w = rng.choice(loading)
            s = stages()
            feed(RegisterWorker(w.worker_id, s[0], rng.randrange(1, 4), w.labels, None, s))
        elif roll < 0.95 and running:
            w, rid = rng.choice(running)
            r = next(r for r in snap.requests if r.request_id == rid)
            pick = rng.random()
            if w.state != "serving" and pick < 0.5:
                feed(ItemYielded(w.worker_id, rid, r.stage, r.attempt))
            elif pick < 0.05:
                feed(ItemFailed(w.worker_id, rid, r.stage, r.attempt, "flaky"))
            else:
                feed(ItemDone(w.worker_id, rid, r.stage, r.attempt, f"{rid}:{r.stage}".encode()))
        elif snap.requests and roll < 0.96:
            feed(Cancel(rng.choice(snap.requests).request_id))
        else:
            feed(Tick())
    return accepted, seen


CHAOS = OrchestratorConfig(heartbeat_timeout=1e6, max_attempts=6)


@pytest.mark.parametrize("policy", ["affinity", "least_loaded", "round_robin"])
@pytest.mark.parametrize("seed", range(4))
def test_random_changes_and_drains_lose_nothing_and_complete_nothing_twice(policy, seed):
    h = Harness(CHAOS, create_policy(policy))
    accepted, seen = _chaos(h, random.Random(seed), 1200)
    assert seen["LoadStages"] > 5 and seen["WorkerRemoved"] > 5 and seen["Preempt"] > 0, seen
    # the end: every loading worker answers, a fresh worker serves every stage
    for w in h.core.snapshot().workers:
        if w.state == "loading":
            worker(h, w.worker_id, w.stages)
    worker(h, "last", STAGES, 4)
    h.drain()
    assert set(h.outcomes) == accepted  # nothing lost; the harness: nothing twice
    completed = [o for o in h.outcomes.values() if isinstance(o, RequestCompleted)]
    assert len(completed) > 50 and len(h.dispatched) > 200


@pytest.mark.parametrize("seed", range(3))
def test_random_changes_and_drains_replay_from_the_journal(tmp_path, seed):
    path = tmp_path / "orch.db"
    h = Harness(CHAOS)
    h.core = JournaledOrchestrator.open(  # type: ignore[assignment]
        path, CHAOS, clock=h.clock, policy=create_policy("least_loaded")
    )
    _, seen = _chaos(h, random.Random(seed), 600)
    assert seen["LoadStages"] and seen["WorkerRemoved"], seen
    before, running = h.core.snapshot(), h.running()
    assert {w.state for w in before.workers} - {"serving"}, before.workers  # mid-change
    h.core.close()
    rec = JournaledOrchestrator.open(
        path, CHAOS, clock=VirtualClock(), policy=create_policy("least_loaded")
    )
    try:
        assert rec.snapshot() == before
        key = sorted((d.worker_id, d.item.request_id, d.item.attempt) for d in running)
        got = sorted(
            (d.worker_id, d.item.request_id, d.item.attempt) for d in rec.recovered_dispatches
        )
        assert got == key
    finally:
        rec.close()

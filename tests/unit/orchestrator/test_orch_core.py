"""The orchestrator core's rules, one event at a time under a virtual clock."""

from __future__ import annotations

import gc
import tracemalloc

import msgspec
import pytest
from orch_harness import Harness, check_invariants, one, only

from mooncake_diffusion.errors import ConfigError, MooncakeDiffusionError
from mooncake_diffusion.orchestrator import (
    Cancel,
    ClockError,
    Dispatch,
    Heartbeat,
    ItemDone,
    ItemFailed,
    Orchestrator,
    OrchestratorConfig,
    OrchestratorConfigError,
    PolicyContractError,
    RegisterWorker,
    Rejected,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Revoke,
    SloClass,
    Submit,
    Tick,
    VirtualClock,
    WorkerLost,
    WorkerRemoved,
    create_policy,
)

pytestmark = pytest.mark.unit


def cluster(h: Harness, denoise: int = 1, decode_credits: int = 4) -> None:
    h.worker("enc-0", "encode", 2, node="n0")
    for i in range(denoise):
        h.worker(f"den-{i}", "denoise", 1, node=f"n{i}")
    h.worker("dec-0", "decode", decode_credits, node="n0")


# ----------------------------------------------------------------------------- stage graph
def test_a_request_runs_encode_then_denoise_then_decode_passing_handles():
    h = Harness()
    cluster(h)
    enc = one(h.feed(Submit("r1", "interactive", params=b"prompt")), Dispatch)
    assert (enc.worker_id, enc.item.stage, enc.item.attempt) == ("enc-0", "encode", 1)
    assert enc.item.params == b"prompt" and enc.item.input == b"" and enc.item.hint == {}
    den = one(h.finish(enc, b"emb-handle"), Dispatch)
    assert (den.item.stage, den.item.input, den.item.hint) == (
        "denoise",
        b"emb-handle",
        {"node": "n0"},
    )
    assert den.item.params == b"prompt"
    dec = one(h.finish(den, b"latent-handle"), Dispatch)
    assert (dec.item.stage, dec.item.input) == ("decode", b"latent-handle")
    acts = h.finish(dec, b"video-handle")
    done = one(acts, RequestCompleted)
    assert done.output == b"video-handle" and done.deadline_met
    assert one(acts, ReleasePayloads).handles == (b"emb-handle", b"latent-handle")
    assert h.core.snapshot().requests == ()


def test_cached_embeddings_skip_encode():
    h = Harness()
    cluster(h)
    den = one(h.feed(Submit("r1", cached_embeddings=b"cached-emb")), Dispatch)
    assert den.item.stage == "denoise" and den.item.input == b"cached-emb"
    dec = one(h.finish(den, b"lat"), Dispatch)
    acts = h.finish(dec)
    assert one(acts, ReleasePayloads).handles == (b"lat",)  # the cache's handle is not ours
    assert not [d for d in h.dispatched if d.item.stage == "encode"]


def test_a_denoise_job_is_pinned_to_its_worker_until_done():
    h = Harness()
    cluster(h, denoise=2)
    den = one(h.feed(Submit("r1", cached_embeddings=b"e")), Dispatch)
    other = "den-1" if den.worker_id == "den-0" else "den-0"
    for _ in range(5):  # time passes, both heartbeat, other work arrives: it never moves
        h.clock.advance(1.0)
        h.feed(Heartbeat("den-0"))
        h.feed(Heartbeat("den-1"))
    rej = one(h.feed(ItemDone(other, "r1", "denoise", 1, b"x")), Rejected)
    assert rej.code == "not_held"
    assert [d.item.stage for d in h.dispatched] == ["denoise"]
    assert one(h.finish(den), Dispatch).item.stage == "decode"


def test_encode_is_a_work_queue_any_worker_takes_the_next_item():
    h = Harness(policy=create_policy("round_robin"))
    h.worker("enc-0", "encode", 1)
    h.worker("enc-1", "encode", 1)
    acts = []
    for i in range(4):
        acts += h.feed(Submit(f"r{i}"))
    first = only(acts, Dispatch)
    assert [(d.worker_id, d.item.request_id) for d in first] == [("enc-0", "r0"), ("enc-1", "r1")]
    nxt = one(h.finish(first[1]), Dispatch)  # enc-1 frees first: it takes r2
    assert (nxt.worker_id, nxt.item.request_id) == ("enc-1", "r2")


# ----------------------------------------------------------------------------- credits
def test_dispatch_only_against_advertised_credits_and_shrink_retires_them():
    h = Harness()
    h.worker("enc-0", "encode", 2)
    acts = []
    for i in range(6):
        acts += h.feed(Submit(f"r{i}"))
    assert len(only(acts, Dispatch)) == 2
    assert len(only(h.feed(Heartbeat("enc-0", credits=3)), Dispatch)) == 1
    assert only(h.feed(Heartbeat("enc-0", credits=1)), Dispatch) == []  # held 3 > 1
    w = h.core.snapshot().workers[0]
    assert (w.advertised, w.held, w.free) == (1, 3, 0)
    held = list(h.dispatched)
    assert only(h.finish(held[0]), Dispatch) == []  # 2 held, 1 advertised
    assert only(h.finish(held[1]), Dispatch) == []  # 1 held, 1 advertised
    assert len(only(h.finish(held[2]), Dispatch)) == 1  # now a credit is free


def test_denoise_is_admitted_only_with_a_reservable_decode_credit():
    h = Harness()
    h.worker("den-0", "denoise", 1)
    h.worker("den-1", "denoise", 1)
    assert only(h.feed(Submit("a", cached_embeddings=b"e")), Dispatch) == []  # no decode pool
    acts = h.worker("dec-0", "decode", 1)
    a = one(acts, Dispatch)  # one decode credit: one admission
    assert a.item.request_id == "a" and h.core.snapshot().decode_reserved == 1
    assert only(h.feed(Submit("b", cached_embeddings=b"e")), Dispatch) == []  # den-1 idle
    dec = one(h.finish(a), Dispatch)  # the latent takes the reserved credit
    assert dec.item.stage == "decode" and h.core.snapshot().decode_reserved == 0
    assert only(h.feed(Tick()), Dispatch) == []  # still no free decode credit
    b = one(h.finish(dec), Dispatch)
    assert (b.item.request_id, b.item.stage) == ("b", "denoise")


def test_a_slow_decode_pool_bounds_the_latents_in_flight():
    h = Harness()
    for i in range(8):
        h.worker(f"den-{i}", "denoise", 1)
    h.worker("dec-0", "decode", 2)
    for i in range(20):
        h.feed(Submit(f"r{i}", cached_embeddings=b"e"))
    pending = list(h.dispatched)
    peak = 0
    while pending:
        d = pending.pop(0)
        h.clock.advance(1.0 if d.item.stage == "denoise" else 5.0)  # decode is the slow one
        pending += only(h.finish(d), Dispatch)
        s = h.core.snapshot()
        latents = [
            r for r in s.requests if r.stage in ("denoise", "decode") and r.state == "running"
        ]
        latents += [r for r in s.requests if r.stage == "decode" and r.state == "queued"]
        peak = max(peak, len(latents))
        assert len(latents) <= 2  # never more latents than decode credits
        for w in h.core.snapshot().workers:
            h.feed(Heartbeat(w.worker_id))
    assert peak == 2 and len(only(list(h.outcomes.values()), RequestCompleted)) == 20


# ----------------------------------------------------------------------------- cancellation
def test_cancel_a_queued_request():
    h = Harness()
    h.worker("enc-0", "encode", 1)
    h.feed(Submit("r1"))
    h.feed(Submit("r2"))
    acts = h.feed(Cancel("r2", "client went away"))
    assert one(acts, RequestCancelled).reason == "client went away"
    assert one(acts, ReleasePayloads).handles == ()
    assert not only(acts, Revoke) and not only(acts, Dispatch)
    assert h.core.snapshot().queued["encode"] == ()
    assert one(h.feed(Cancel("r2")), Rejected).code == "already_finished"


def test_cancel_a_running_denoise_releases_its_credits_and_revokes_the_item():
    h = Harness()
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 1)
    a = one(h.feed(Submit("a", cached_embeddings=b"e")), Dispatch)
    h.feed(Submit("b", cached_embeddings=b"e"))
    assert h.core.snapshot().decode_reserved == 1
    acts = h.feed(Cancel("a"))
    assert [type(x) for x in acts] == [Revoke, RequestCancelled, ReleasePayloads, Dispatch]
    rev = acts[0]
    assert (rev.worker_id, rev.request_id, rev.stage, rev.attempt) == ("den-0", "a", "denoise", 1)
    b = acts[-1]  # both the denoise credit and the decode reservation came back
    assert (b.worker_id, b.item.request_id) == ("den-0", "b")
    assert one(h.finish(a), Rejected).code == "stale_attempt"  # a late result is dropped


def test_cancel_with_a_latent_waiting_releases_reservation_and_latent():
    h = Harness()
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 1)
    den = one(h.feed(Submit("a", cached_embeddings=b"e")), Dispatch)
    h.feed(Heartbeat("dec-0", credits=0))  # decode pool stalls: the latent will wait
    assert only(h.finish(den, b"latent-a"), Dispatch) == []
    assert h.core.snapshot().decode_reserved == 1
    acts = h.feed(Cancel("a"))
    assert one(acts, ReleasePayloads).handles == (b"latent-a",)
    assert h.core.snapshot().decode_reserved == 0


# ----------------------------------------------------------------------------- failures
def test_missed_heartbeat_requeues_decode_without_recompute():
    h = Harness(heartbeat_timeout=5.0)
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 1, node="n0")
    den = one(h.feed(Submit("a", cached_embeddings=b"e")), Dispatch)
    dec = one(h.finish(den, b"latent-a"), Dispatch)
    assert (dec.worker_id, dec.item.attempt) == ("dec-0", 1)
    h.worker("dec-1", "decode", 1, node="n1")
    for _ in range(4):  # dec-0 goes silent; everyone else keeps beating
        h.clock.advance(2.0)
        acts = h.feed(Heartbeat("den-0")) + h.feed(Heartbeat("dec-1"))
        if only(acts, WorkerRemoved):
            break
    gone = one(acts, WorkerRemoved)
    assert (gone.worker_id, gone.requeued, gone.failed) == ("dec-0", ("a",), ())
    assert one(acts, Requeued).attempt == 1
    again = one(acts, Dispatch)
    assert (again.worker_id, again.item.attempt, again.item.input) == ("dec-1", 2, b"latent-a")
    assert [d.item.stage for d in h.dispatched].count("denoise") == 1  # no recompute
    late = h.feed(ItemDone("dec-0", "a", "decode", 1, b"late"))  # the old worker wakes up
    assert one(late, Rejected).code == "stale_attempt"  # dropped by its attempt
    assert one(h.finish(again, b"video"), RequestCompleted).output == b"video"


def test_worker_deadline_is_exact_and_next_deadline_reports_it():
    h = Harness(heartbeat_timeout=10.0)
    h.worker("enc-0", "encode", 1)
    h.feed(RegisterWorker("enc-1", "encode", 1, heartbeat_timeout=20.0))
    assert h.core.next_deadline() == 10.0
    h.clock.set(9.999)
    assert only(h.feed(Tick()), WorkerRemoved) == []
    h.clock.set(10.0)
    assert one(h.feed(Tick()), WorkerRemoved).worker_id == "enc-0"
    assert h.core.next_deadline() == 20.0
    h.clock.set(13.0)
    d = one(h.feed(Submit("r")), Dispatch)  # a dispatch is not a sign of life ...
    assert h.core.next_deadline() == 20.0
    h.clock.set(15.0)
    h.finish(d)  # ... but any event from the worker is, a result included
    assert h.core.next_deadline() == 35.0
    h.clock.set(30.0)
    h.feed(Heartbeat("enc-1"))
    assert h.core.next_deadline() == 50.0


def test_late_duplicate_result_is_dropped_by_attempt():
    h = Harness()
    h.worker("enc-0", "encode", 1)
    h.worker("enc-1", "encode", 1)
    d1 = one(h.feed(Submit("r")), Dispatch)
    acts = h.feed(ItemFailed(d1.worker_id, "r", "encode", 1, "CUDA OOM"))
    d2 = one(acts, Dispatch)
    assert d2.item.attempt == 2
    stale = one(h.finish(d1, b"first"), Rejected)  # attempt 1 comes back after all
    assert stale.code == "stale_attempt" and "attempt 2 is current" in stale.reason
    den_before = len(h.dispatched)
    assert not only(h.finish(d2, b"second"), Rejected)
    assert len(h.dispatched) == den_before  # no denoise pool: it waits, once
    assert h.core.snapshot().requests[0].stage == "denoise"
    assert one(h.finish(d2, b"again"), Rejected).code == "stale_attempt"  # encode already done


def test_result_of_a_requeued_attempt_before_redispatch_is_stale():
    h = Harness()
    h.worker("enc-0", "encode", 1)
    d = one(h.feed(Submit("r")), Dispatch)
    acts = h.feed(WorkerLost("enc-0", "supervisor saw exit"))
    assert one(acts, Requeued).reason == "encode attempt 1 on enc-0: supervisor saw exit"
    h.worker("enc-0", "encode", 1)  # the same id restarts; it gets attempt 2
    redo = h.dispatched[-1]
    assert (redo.worker_id, redo.item.attempt) == ("enc-0", 2)
    assert one(h.finish(d), Rejected).code == "stale_attempt"


def test_max_attempts_fails_the_request_with_every_reason():
    h = Harness(max_attempts=3)
    h.worker("den-0", "denoise", 1)
    h.worker("dec-0", "decode", 1)
    den = one(h.feed(Submit("r", cached_embeddings=b"e")), Dispatch)
    dec = one(h.finish(den, b"lat"), Dispatch)
    reasons = []
    for n in range(3):
        acts = h.feed(WorkerLost("dec-0", f"crash {n}"))
        reasons.append(f"decode attempt {n + 1} on dec-0: crash {n}")
        if n < 2:
            h.worker("dec-0", "decode", 1)
            assert h.dispatched[-1].item.attempt == n + 2
    failed = one(acts, RequestFailed)
    assert failed.reasons == tuple(reasons)
    assert one(acts, WorkerRemoved).failed == ("r",)
    assert one(acts, ReleasePayloads).handles == (b"lat",)
    assert h.core.snapshot().decode_reserved == 0 and dec.item.attempt == 1


def test_non_retryable_failure_fails_at_once():
    h = Harness()
    h.worker("enc-0", "encode", 1)
    d = one(h.feed(Submit("r")), Dispatch)
    acts = h.feed(ItemFailed("enc-0", "r", "encode", 1, "prompt rejected", retryable=False))
    assert one(acts, RequestFailed).reasons == ("encode attempt 1 on enc-0: prompt rejected",)
    assert d.item.attempt == 1 and not only(acts, Requeued)


def test_a_lost_denoise_job_releases_its_reservation_and_is_admitted_again():
    h = Harness()
    h.worker("den-0", "denoise", 1)
    h.worker("den-1", "denoise", 1)
    h.worker("dec-0", "decode", 1)
    d = one(h.feed(Submit("r", cached_embeddings=b"e")), Dispatch)
    acts = h.feed(WorkerLost(d.worker_id))
    again = one(acts, Dispatch)
    assert again.worker_id != d.worker_id and again.item.attempt == 2
    assert h.core.snapshot().decode_reserved == 1


# ----------------------------------------------------------------------------- bad input
def _unchanged(h: Harness, event, code: str) -> None:
    before = msgspec.structs.replace(h.core.snapshot(), now=0.0)
    acts = h.feed(event)
    assert [type(a) for a in acts] == [Rejected], acts
    assert acts[0].code == code, acts[0]
    assert acts[0].event == type(event).__name__ and acts[0].reason
    assert msgspec.structs.replace(h.core.snapshot(), now=0.0) == before


@pytest.fixture
def busy() -> Harness:
    """Work in every state: r0 at decode (running), r1 denoising, r2 queued, r9 finished."""
    h = Harness()
    h.worker("enc-0", "encode", 1)
    h.worker("den-0", "denoise", 1)
    h.worker("den-1", "denoise", 1)
    h.worker("dec-0", "decode", 2)
    h.feed(Submit("r9", cached_embeddings=b"e"))
    h.finish(h.dispatched[-1])
    h.finish(h.dispatched[-1])
    h.feed(Submit("r0", cached_embeddings=b"e"))
    h.feed(Submit("r1", cached_embeddings=b"e"))
    h.finish(h.dispatched[-2])  # r0 -> decode
    h.feed(Submit("r2", cached_embeddings=b"e"))
    s = h.core.snapshot()
    assert {(r.request_id, r.stage, r.state) for r in s.requests} == {
        ("r0", "decode", "running"),
        ("r1", "denoise", "running"),
        ("r2", "denoise", "queued"),
    }
    return h


@pytest.mark.parametrize(
    ("event", "code"),
    [
        (RegisterWorker("w", "upscale"), "unknown_stage"),
        (ItemDone("dec-0", "r0", "upscale", 1), "unknown_stage"),
        (Submit("r1"), "duplicate_request"),  # live
        (Submit("r9"), "duplicate_request"),  # finished
        (Submit("r5", slo_class="urgent"), "unknown_class"),
        (Submit(""), "bad_value"),
        (Submit("r5", params=b"x" * 70000), "bad_value"),
        (Submit("r5", cached_embeddings=b""), "bad_value"),
        (RegisterWorker("dec-0", "decode"), "duplicate_worker"),
        (RegisterWorker("w", "decode", credits=-1), "bad_value"),
        (RegisterWorker("w", "decode", labels={"node": ""}), "bad_value"),
        (RegisterWorker("w", "decode", heartbeat_timeout=0), "bad_value"),
        (Heartbeat("ghost"), "unknown_worker"),
        (Heartbeat("dec-0", credits=-2), "bad_value"),
        (WorkerLost("ghost"), "unknown_worker"),
        (ItemDone("den-0", "r0", "decode", 1), "not_held"),  # another worker's item
        (ItemDone("dec-0", "r1", "decode", 1), "not_held"),  # the request is not there yet
        (ItemDone("dec-0", "r0", "decode", 2), "not_held"),  # an attempt never dispatched
        (ItemDone("den-0", "r2", "denoise", 1), "not_held"),  # queued, never dispatched
        (ItemDone("den-0", "r2", "denoise", 0), "not_held"),  # attempts count from 1
        (ItemDone("enc-0", "r1", "encode", 1), "not_held"),  # encode was skipped
        (ItemDone("den-0", "r0", "denoise", 1), "stale_attempt"),  # denoise already done
        (ItemDone("dec-0", "r9", "decode", 1), "stale_attempt"),  # request finished
        (ItemFailed("dec-0", "r7", "decode", 1, "x"), "unknown_request"),
        (ItemDone("dec-0", "r0", "decode", 1, b"x" * 70000), "bad_value"),
        (Cancel("nope"), "unknown_request"),
        (Cancel("r9"), "already_finished"),
        (Dispatch("w", None), "bad_event"),  # an action is not an event
    ],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,
)
def test_bad_input_is_rejected_and_changes_nothing(busy: Harness, event, code: str):
    _unchanged(busy, event, code)
    busy.drain()  # and the work in flight still completes
    assert sorted(busy.outcomes) == ["r0", "r1", "r2", "r9"]
    assert all(isinstance(a, RequestCompleted) for a in busy.outcomes.values())


# ----------------------------------------------------------------------------- clock, config
def test_time_must_not_go_backwards_and_needs_a_source():
    core = Orchestrator(OrchestratorConfig())
    with pytest.raises(ClockError):
        core.handle(Tick())
    core.handle(Tick(), now=5.0)
    with pytest.raises(ClockError):
        core.handle(Tick(), now=4.0)
    assert core.now == 5.0
    clock = VirtualClock(100.0)
    with pytest.raises(ClockError):
        clock.advance(-1)
    with pytest.raises(ClockError):
        clock.set(99.0)
    assert issubclass(ClockError, MooncakeDiffusionError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"classes": ()},
        {"classes": (SloClass("a", 0, 1.0), SloClass("a", 1, 1.0))},
        {"default_class": "nope"},
        {"max_attempts": 0},
        {"heartbeat_timeout": 0.0},
        {"finished_memory": -1},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(OrchestratorConfigError):
        OrchestratorConfig(**kwargs)


def test_bad_slo_class_raises_and_errors_join_the_package_tree():
    with pytest.raises(ConfigError):
        SloClass("x", 0, deadline=0.0)
    with pytest.raises(ValueError):
        SloClass("x", 0, deadline=1.0, max_wait=-1.0)
    with pytest.raises(OrchestratorConfigError, match="unknown routing policy 'nope'"):
        Orchestrator(OrchestratorConfig(policy="nope"))


def test_finished_ids_are_remembered_up_to_a_bound():
    h = Harness(finished_memory=2)
    h.worker("enc-0", "encode", 1)
    for r in ("a", "b", "c"):
        h.feed(Submit(r))
        h.feed(Cancel(r))
    assert list(h.core.snapshot().finished) == ["b", "c"]
    assert one(h.feed(Submit("b")), Rejected).code == "duplicate_request"
    assert not only(h.feed(Submit("a")), Rejected)  # forgotten: accepted again
    h.core.handle(Cancel("a"))  # finished again (past the harness's once-only check)
    assert list(h.core.snapshot().finished) == ["c", "a"]  # "b" forgotten now
    assert one(h.core.handle(Submit("c")), Rejected).code == "duplicate_request"
    assert not only(h.core.handle(Submit("b")), Rejected)


def _busy_core() -> None:
    """A core with 300 requests live (encode items running and queued, four at
    denoise) and one worker lost with items on it, dropped with all of it in flight."""
    core = Orchestrator(OrchestratorConfig(), clock=VirtualClock())
    for i in range(32):
        core.handle(RegisterWorker(f"e{i}", "encode", 4, {"node": f"n{i % 2}"}))
    for i in range(4):
        core.handle(RegisterWorker(f"n{i}", "denoise", 1, {"node": f"n{i % 2}"}))
    core.handle(RegisterWorker("d0", "decode", 4, {"node": "n0"}))
    dispatched = []
    for i in range(300):
        dispatched += [
            a for a in core.handle(Submit(f"r{i}", params=b"p" * 64)) if type(a) is Dispatch
        ]
    for d in dispatched[:4]:
        core.handle(ItemDone(d.worker_id, d.item.request_id, "encode", d.item.attempt, b"emb"))
    core.handle(WorkerLost("e1"))
    records = list(core._requests.values())
    running = [r for r in records if r.worker is not None]
    assert len(records) == 300 and len(running) > 100
    # the collector does not track a record, and nothing a record holds holds it
    assert not any(gc.is_tracked(r) for r in records)
    assert all(r.rid in r.worker.running for r in running)  # ids, not records
    assert not gc.is_tracked(core._finished)


def test_request_records_are_not_tracked_by_the_collector_and_go_with_their_core():
    """A fleet keeps thousands of requests live, and every full collection walked
    them all; their records are untracked, which is sound only while no reference
    cycle runs through one. Were there one, each core dropped here would leave its
    running records (and their workers) behind: about 80 KB a core."""
    _busy_core()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(5):
            _busy_core()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 50_000, f"{grown} bytes not freed after five cores were dropped"


def test_same_events_give_the_same_actions():
    def run() -> list[bytes]:
        h = Harness(policy=create_policy("affinity"))
        cluster(h, denoise=3)
        h.worker("dec-1", "decode", 2, node="n2")
        out = []
        for i in range(12):
            out += h.feed(Submit(f"r{i}", "batch" if i % 3 else "interactive"), at=i * 0.5)
        while h.core.snapshot().requests:
            running = h.running()
            d = running[len(running) // 2]
            h.clock.advance(0.25)
            out += h.finish(d)
        return [msgspec.msgpack.encode(a) for a in out]

    first = run()
    assert first == run() and len(first) > 40


class _Rogue:
    def choose(self, item, candidates):
        return object()


class _Stale:
    """Returns the worker it was given to keep, whatever the candidates."""

    def __init__(self) -> None:
        self.kept: object = None

    def choose(self, item, candidates):
        return self.kept


def test_a_policy_that_breaks_its_contract_raises_and_leaves_state_consistent():
    h = Harness(policy=_Rogue())
    with pytest.raises(PolicyContractError) as e:
        h.feed(RegisterWorker("enc-0", "encode", 1))
        h.feed(Submit("r"))
    assert e.value.actions == []
    check_invariants(h.core)
    assert h.core.snapshot().queued["encode"] == ("r",)


@pytest.mark.parametrize("other_core", [True, False], ids=["other-core", "removed"])
def test_a_worker_not_live_in_this_core_is_refused(other_core):
    """Membership is checked on the worker itself (``Worker.owner``), not by id: a
    worker object of another core, or one this core dropped, is refused though a live
    worker of the same id, serving with a free credit, exists here."""
    policy = _Stale()
    h = Harness(policy=policy)
    h.feed(RegisterWorker("enc-0", "encode", 2))
    if other_core:
        other = Orchestrator(OrchestratorConfig(), policy=create_policy("round_robin"))
        other.handle(RegisterWorker("enc-0", "encode", 2), now=0.0)
        policy.kept = other._pools.workers["enc-0"]
    else:
        policy.kept = h.core._pools.workers["enc-0"]
        h.feed(WorkerLost("enc-0"))
        h.feed(RegisterWorker("enc-0", "encode", 2))  # a new enc-0, live and free
    assert policy.kept is not h.core._pools.workers["enc-0"]
    with pytest.raises(PolicyContractError, match="not a serving encode worker"):
        h.feed(Submit("r"))
    check_invariants(h.core)
    assert h.core.snapshot().queued["encode"] == ("r",)
    policy.kept = h.core._pools.workers["enc-0"]  # the live one is taken
    h.feed(Tick())
    assert h.core.snapshot().queued["encode"] == () and len(h.dispatched) == 1

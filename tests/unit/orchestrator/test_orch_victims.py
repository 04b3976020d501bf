"""The preemption rule decides from ``victims.py``'s index as it did from a scan of
every running denoise job: two cores, one with the old scan as its ``_preempt``,
see the same random event sequences (preemption on, three classes, workers that
yield when asked, die, fail and get cancelled) and must answer the same actions."""

from __future__ import annotations

import random
import types

import msgspec
import pytest
from orch_harness import check_invariants

from mooncake_diffusion.orchestrator import (
    Action,
    Cancel,
    Heartbeat,
    ItemDone,
    ItemFailed,
    ItemYielded,
    Orchestrator,
    OrchestratorConfig,
    Preempt,
    RegisterWorker,
    SloClass,
    Submit,
    Tick,
    VirtualClock,
    WorkerLost,
    create_policy,
)

pytestmark = pytest.mark.unit

CLASSES = (
    SloClass("interactive", priority=0, deadline=30.0),
    SloClass("standard", priority=1, deadline=600.0),
    SloClass("batch", priority=2, deadline=3600.0, max_wait=60.0),
)


def scan_preempt(self: Orchestrator, out: list[Action]) -> None:
    """The rule as it was: list every running denoise job, sort, walk (the reference)."""
    q = self._queues["denoise"]
    if not q or self._pools.free_total["denoise"] > 0:
        return
    running = [
        self._requests[rid]
        for w in self._pools.workers.values()
        if w.stage == "denoise"
        for rid in w.running
    ]
    pending = sum(r.preempting for r in running)
    victims = sorted(
        (r for r in running if not r.preempting and r.yields < self.config.max_preemptions),
        key=lambda r: (-r.cls.priority, -r.started, r.rid),
    )
    for v in victims:
        if q.waiting_better_than(v.cls.priority) <= pending:
            break
        v.preempting = True
        pending += 1
        out.append(
            Preempt(
                v.worker.worker_id,
                v.rid,
                "denoise",
                v.attempt,
                "a higher-priority denoise job waits",
            )
        )


@pytest.mark.parametrize("seed", range(8))
def test_the_victim_index_preempts_as_the_scan_did(seed):
    rng = random.Random(seed)
    cfg = OrchestratorConfig(
        classes=CLASSES, preemption=True, max_preemptions=2, heartbeat_timeout=30.0, max_attempts=6
    )
    indexed = Orchestrator(cfg, clock=VirtualClock(), policy=create_policy("least_loaded"))
    reference = Orchestrator(cfg, clock=VirtualClock(), policy=create_policy("least_loaded"))
    reference._preempt = types.MethodType(scan_preempt, reference)  # type: ignore[method-assign]
    live: list[str] = []
    asked: list[Preempt] = []
    now, preempts = 0.0, 0
    for n in range(1500):
        now += rng.choice([0.0, 0.01, 0.5, 4.0])
        snap = reference.snapshot()
        running = [(w, rid) for w in snap.workers for rid in w.running]
        roll = rng.random()
        if roll < 0.08 or not live:
            stage = rng.choice(["encode", "denoise", "denoise", "decode"])
            live.append(f"{stage}-{n}")
            ev = RegisterWorker(live[-1], stage, rng.randrange(1, 4), {}, 30.0)
        elif roll < 0.12:
            ev = Heartbeat(rng.choice(live), rng.choice([None, 1, 2]))
        elif roll < 0.14:
            ev = WorkerLost(live.pop(rng.randrange(len(live))))
        elif roll < 0.45:
            cls = rng.choice(["interactive", "standard", "batch", "batch"])
            ev = Submit(f"r{n}", cls, b"p", b"emb" if rng.random() < 0.5 else None)
        elif roll < 0.6 and asked:
            p = asked.pop(rng.randrange(len(asked)))
            ev = ItemYielded(p.worker_id, p.request_id, "denoise", p.attempt)
        elif roll < 0.93 and running:
            w, rid = rng.choice(running)
            att = next(r.attempt for r in snap.requests if r.request_id == rid)
            if rng.random() < 0.08:
                ev = ItemFailed(w.worker_id, rid, w.stage, att, "flaky")
            else:
                ev = ItemDone(w.worker_id, rid, w.stage, att, b"out")
        elif roll < 0.96 and snap.requests:
            ev = Cancel(rng.choice(snap.requests).request_id)
        else:
            ev = Tick()
        want = reference.handle(ev, now=now)
        got = indexed.handle(ev, now=now)
        assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(want), (n, ev)
        asked += [a for a in got if isinstance(a, Preempt)]
        preempts += sum(isinstance(a, Preempt) for a in got)
        live[:] = [w for w in live if w in reference._pools.workers]
        if n % 100 == 0:
            check_invariants(indexed)
    assert indexed.snapshot() == reference.snapshot()
    assert preempts >= 10  # the rule fired often, not a handful of times


def test_the_victim_heap_stays_bounded_by_the_running_jobs():
    cfg = OrchestratorConfig(preemption=True, heartbeat_timeout=1e9)
    core = Orchestrator(cfg, policy=create_policy("round_robin"))
    core.handle(RegisterWorker("den", "denoise", 2), now=0.0)
    core.handle(RegisterWorker("dec", "decode", 1000), now=0.0)
    for i in range(2000):  # jobs start and finish; their entries must not pile up
        core.handle(Submit(f"r{i}", "batch", cached_embeddings=b"e"), now=float(i))
        core.handle(ItemDone("den", f"r{i}", "denoise", 1, b"l"), now=float(i))
        core.handle(ItemDone("dec", f"r{i}", "decode", 1, b"x"), now=float(i))
    assert len(core._victims._heap) <= 2 * 2 + 17

"""Routing indexes (``indexes.py``) make the same decisions as the policies' ``choose``.

Two cores see the same random event sequence: one with a built-in policy (the
core asks its index), one with the same policy hidden behind a wrapper that has
only ``choose`` (the core builds the candidate list and scans it: the
brute-force reference). Every action of every event must be equal.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from orch_harness import check_invariants

from mooncake_diffusion.orchestrator import (
    STAGES,
    Cancel,
    Dispatch,
    Drain,
    Event,
    Heartbeat,
    ItemDone,
    ItemFailed,
    ItemYielded,
    LeastLoaded,
    Orchestrator,
    OrchestratorConfig,
    Reassign,
    RegisterWorker,
    RoundRobin,
    Submit,
    Tick,
    VirtualClock,
    WorkerLost,
    WorkItem,
    create_policy,
)
from mooncake_diffusion.orchestrator.core.indexes import AffinityIndex, RoundRobinIndex
from mooncake_diffusion.orchestrator.core.pools import Worker

pytestmark = pytest.mark.unit

POLICIES = [
    ("round_robin", {}),
    ("least_loaded", {}),
    ("affinity", {}),
    ("affinity", {"keys": ("rail",)}),
    ("affinity", {"keys": ("node", "rail", "numa", "zone")}),
]


class ChooseOnly:
    """The policy's ``choose`` and nothing else: the core falls back to a full scan."""

    def __init__(self, name: str, options: dict) -> None:
        self.inner = create_policy(name, **options)

    def choose(self, item, candidates):  # type: ignore[no-untyped-def]
        return self.inner.choose(item, candidates)


def _labels(rng: random.Random) -> dict[str, str]:
    labels = {}
    for key, values in (("node", 4), ("rail", 3), ("numa", 2), ("zone", 2)):
        if rng.random() < 0.8:  # some workers lack a key
            labels[key] = f"{key[0]}{rng.randrange(values)}"
    return labels


def _stages(rng: random.Random) -> tuple[str, ...]:
    """One stage mostly; sometimes several (a worker that holds more than one model)."""
    if rng.random() < 0.6:
        return (rng.choice(STAGES),)
    return tuple(rng.sample(STAGES, rng.randrange(1, len(STAGES) + 1)))


def _events(rng: random.Random, core: Orchestrator, live: list[str], n: int) -> Event:
    """One random event, chosen from the reference core's state."""
    snap = core.snapshot()
    running = [(w, rid) for w in snap.workers for rid in w.running]
    roll = rng.random()
    if roll < 0.08 or not live:
        stages = _stages(rng)
        wid = f"{stages[0]}-{n}"
        live.append(wid)
        return RegisterWorker(wid, stages[0], rng.randrange(0, 4), _labels(rng), 30.0, stages)
    loading = [w for w in snap.workers if w.state == "loading"]
    if loading and rng.random() < 0.3:  # it loaded its new stages (maybe not the ones asked)
        stages = _stages(rng)
        w = rng.choice(loading)
        return RegisterWorker(w.worker_id, stages[0], rng.randrange(0, 4), w.labels, 30.0, stages)
    leaving = [(w, rid) for w, rid in running if w.state != "serving"]
    if leaving and rng.random() < 0.3:  # a worker changing stage or draining gives one back
        w, rid = rng.choice(leaving)
        req = next(r for r in snap.requests if r.request_id == rid)
        return ItemYielded(w.worker_id, rid, req.stage, req.attempt)
    if roll < 0.1:
        return Reassign(rng.choice(live), _stages(rng), "planner")
    if roll < 0.11:
        return Drain(rng.choice(live), "scale-down")
    if roll < 0.16:
        return Heartbeat(rng.choice(live), rng.choice([None, 0, 1, 2, 3, 5]))
    if roll < 0.19:
        wid = live.pop(rng.randrange(len(live)))
        return WorkerLost(wid, "gone")
    if roll < 0.45:
        cached = b"emb" if rng.random() < 0.4 else None
        cls = rng.choice(["interactive", "batch"])
        return Submit(f"r{n}", cls, b"p", cached)
    if roll < 0.9 and running:
        w, rid = rng.choice(running)
        req = next(r for r in snap.requests if r.request_id == rid)
        if rng.random() < 0.1:
            return ItemFailed(w.worker_id, rid, req.stage, req.attempt, "flaky")
        return ItemDone(w.worker_id, rid, req.stage, req.attempt, f"{w.worker_id}:{rid}".encode())
    if roll < 0.93 and snap.requests:
        return Cancel(rng.choice(snap.requests).request_id)
    return Tick()


@pytest.mark.parametrize(("name", "options"), POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_an_index_decides_as_choose_over_every_candidate(name, options, seed):
    rng = random.Random(seed)
    cfg = OrchestratorConfig(heartbeat_timeout=30.0, max_attempts=4)
    indexed = Orchestrator(cfg, clock=VirtualClock(), policy=create_policy(name, **options))
    reference = Orchestrator(cfg, clock=VirtualClock(), policy=ChooseOnly(name, options))
    assert indexed._index is not None and reference._index is None
    live: list[str] = []
    now = 0.0
    dispatches = 0
    kinds: set[str] = set()
    for n in range(1500):
        now += rng.choice([0.0, 0.01, 0.5, 4.0])  # sometimes past a heartbeat deadline
        ev = _events(rng, reference, live, n)
        want = reference.handle(ev, now=now)
        got = indexed.handle(ev, now=now)
        assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(want), (n, ev)
        dispatches += sum(type(a) is Dispatch for a in got)
        kinds.update(type(a).__name__ for a in got)
        live[:] = [w for w in live if w in reference._pools.workers]
        if n % 100 == 0:
            check_invariants(indexed)
    assert indexed.snapshot() == reference.snapshot()
    assert dispatches > 300  # the sequence made many decisions, not a few
    assert {"LoadStages", "WorkerRemoved", "Preempt"} <= kinds  # changes and drains happened


def test_affinity_groups_are_dropped_with_their_last_worker():
    """Groups, and the lanes workers of the same groups share, live as long as a
    worker of theirs does."""
    policy = create_policy("affinity")
    core = Orchestrator(OrchestratorConfig(), policy=policy)
    index = core._index
    assert isinstance(index, AffinityIndex)
    core.handle(RegisterWorker("d0", "decode", 2, {"node": "n0", "rail": "0"}), now=0.0)
    core.handle(RegisterWorker("d1", "decode", 2, {"node": "n1"}), now=0.0)
    core.handle(RegisterWorker("d2", "decode", 2, {"rail": "0", "node": "n0"}), now=0.0)
    groups = len(index._groups)
    assert groups == 4 + 1  # d0: none, node, rail, node+rail; d1: its node (none is shared)
    assert len(index._lanes) == 2  # d0 and d2 share theirs
    core.handle(WorkerLost("d0"), now=1.0)
    assert len(index._groups) == 5 and len(index._lanes) == 2
    assert [index._lanes.holders(w.routing.heaps) for w in core._pools.workers.values()] == [1, 1]
    core.handle(WorkerLost("d2"), now=1.0)
    assert len(index._groups) == 2 and len(index._lanes) == 1
    core.handle(WorkerLost("d1"), now=1.0)
    assert index._groups == {} and index._stamps.free == {}
    assert len(index._lanes) == 0


def test_workers_with_the_same_labels_share_one_dict_until_the_last_leaves():
    """An item's hint is its producer's labels: one dict per label set, so a fleet's
    hints are a few dicts that stay in the cache, not one per worker."""
    core = Orchestrator(OrchestratorConfig(), policy=create_policy("affinity"))
    core.handle(RegisterWorker("d0", "decode", 2, {"node": "n0", "rail": "0"}), now=0.0)
    core.handle(RegisterWorker("d1", "decode", 2, {"rail": "0", "node": "n0"}), now=0.0)
    core.handle(RegisterWorker("d2", "decode", 2, {"node": "n1"}), now=0.0)
    w = core._pools.workers
    assert w["d0"].labels is w["d1"].labels and w["d2"].labels is not w["d0"].labels
    assert w["d1"].labels == {"node": "n0", "rail": "0"}
    core.handle(WorkerLost("d0"), now=1.0)
    core.handle(WorkerLost("d1"), now=1.0)
    assert list(core._pools._labels.values()) == [{"node": "n1"}]
    core.handle(WorkerLost("d2"), now=1.0)
    assert len(core._pools._labels) == 0


def test_a_heap_of_a_group_seldom_asked_stays_bounded():
    """Credits move all the time; stale entries of groups no hint asks for are
    rebuilt away, so memory follows the workers, not the number of decisions."""
    core = Orchestrator(OrchestratorConfig(), policy=create_policy("least_loaded"))
    core.handle(RegisterWorker("d0", "decode", 4), now=0.0)
    core.handle(RegisterWorker("d1", "decode", 4), now=0.0)
    t = 0.0
    for i in range(2000):
        t += 0.001
        core.handle(Heartbeat("d0", 1 + i % 4), now=t)
    heap = core._index._heaps["decode"]  # type: ignore[union-attr]
    # a bucket per credit level seen (4 advertised x up to 4 held), each rebuilt past
    # 2 * members + 16 entries
    assert sum(len(b) for b in heap.buckets.values()) <= len(heap.buckets) * (2 * 2 + 17)
    assert len(heap.buckets) <= 16


def test_round_robin_picks_as_the_rule_while_workers_flap_and_stays_bounded():
    """Round robin's two heaps around the cursor, driven directly: workers go free and
    busy at random (often freed again before their old entry comes up, which leaves
    repeats, and bursts of that with no pick in between), picks take a credit, and the
    cursor is sometimes moved by ``choose`` itself. Every pick is the rule's (the
    smallest free seq after the cursor, else the smallest), and each heap stays within
    2 n + 17 entries for n workers however many changes came."""
    rng = random.Random(7)
    policy = RoundRobin()
    index = policy.index()
    assert isinstance(index, RoundRobinIndex)
    workers = [Worker(f"w{i}", ("decode",), i, {}, 30.0) for i in range(1, 41)]
    for w in workers:
        w.advertised = 2
    item = WorkItem("r", "decode", 1, "batch", 0.0, b"", b"", {})

    def set_free(w: Worker, free: int) -> None:
        w.free = free
        index.update(w) if free else index.remove(w)

    for w in workers:
        set_free(w, rng.randrange(0, 3))
    for step in range(5000):
        roll = rng.random()
        if roll < 0.45 or step % 1500 >= 1000:  # and bursts of changes with no pick
            set_free(rng.choice(workers), rng.randrange(0, 3))
        elif roll < 0.47:  # the cursor moved outside the index
            policy._last["decode"] = rng.randrange(0, 45)
        else:
            last = policy._last.get("decode", -1)
            free = [w for w in workers if w.free > 0]
            want = next((w for w in free if w.seq > last), free[0] if free else None)
            got = index.pick(item)
            assert got is want, (step, last)
            if got is not None:
                assert policy._last["decode"] == got.seq
                set_free(got, got.free - 1)  # dispatched: one credit taken
        ring = index._rings["decode"]  # memory follows the workers, not the changes
        assert max(len(ring.ahead), len(ring.behind)) <= 2 * len(workers) + 17, step
    for w in workers:  # leak check: every worker gone leaves no listed worker
        set_free(w, 0)
    assert index._free == {} and index.pick(item) is None


class MostLoaded(LeastLoaded):
    """A subclass with its own ``choose``: the inherited index must not stand in for it."""

    def choose(self, item, candidates):  # type: ignore[no-untyped-def]
        return max(candidates, key=lambda w: (w.held / w.advertised, w.seq))


def test_a_subclass_that_overrides_choose_is_asked_not_the_inherited_index():
    core = Orchestrator(OrchestratorConfig(), policy=MostLoaded())
    assert core._index is None
    core.handle(RegisterWorker("d0", "decode", 4), now=0.0)
    core.handle(RegisterWorker("d1", "decode", 4), now=0.0)
    for i in range(3):
        core.handle(Submit(f"r{i}", cached_embeddings=b"e"), now=1.0)  # wait for denoise
    core.handle(RegisterWorker("n0", "denoise", 3), now=1.0)
    running = [(w.worker_id, len(w.running)) for w in core.snapshot().workers]
    assert ("n0", 3) in running
    for i in range(3):
        core.handle(ItemDone("n0", f"r{i}", "denoise", 1, b"latent"), now=2.0)
    held = {w.worker_id: len(w.running) for w in core.snapshot().workers}
    assert held["d1"] == 3 or held["d0"] == 3, held  # most loaded: all on one worker

"""Test harness for the orchestrator core: feeds events under a virtual clock and
checks every invariant after every event."""

from __future__ import annotations

from collections import Counter
from typing import TypeVar

from mooncake_diffusion.orchestrator import (
    STAGES,
    Action,
    Dispatch,
    Event,
    ItemDone,
    Orchestrator,
    OrchestratorConfig,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RoutingPolicy,
    Tick,
    VirtualClock,
    create_policy,
)
from mooncake_diffusion.orchestrator import RegisterWorker as Register

A = TypeVar("A")
TERMINAL = (RequestCompleted, RequestFailed, RequestCancelled)


def check_invariants(core: Orchestrator) -> None:
    """Every rule about credits, reservations and request states, from a snapshot."""
    s = core.snapshot()
    reqs = {r.request_id: r for r in s.requests}
    workers = {w.worker_id: w for w in s.workers}
    assert len(reqs) == len(s.requests) and len(workers) == len(s.workers)
    for w in s.workers:
        assert w.advertised >= 0 and w.held >= 0 and w.free >= 0, w  # never negative
        assert w.held + w.free == max(w.advertised, w.held), w  # reserved + free == advertised
        assert w.held == len(w.running), w  # a held credit per running item, no more
        for rid in w.running:
            r = reqs[rid]
            assert r.state == "running" and r.worker_id == w.worker_id, (w, r)
            assert r.stage in w.stages, (w, r)
        assert w.stages and w.stage == w.stages[0] and len(set(w.stages)) == len(w.stages), w
        assert w.state != "loading" or not w.running, w  # it loads only once it holds nothing
    for stage in STAGES:  # a worker's free credits count once in each stage it serves
        serving = [w for w in s.workers if stage in w.stages and w.state == "serving"]
        assert s.free_credits[stage] == sum(w.free for w in serving)
    holders = Counter(rid for w in s.workers for rid in w.running)
    for r in s.requests:
        # a yield (preemption, stage change, drain) is a dispatch that is not a failed attempt
        assert 0 <= r.yields <= r.attempt and r.attempt - r.yields <= core.config.max_attempts, r
        if r.state == "running":  # exactly one worker, alive, of the right stage
            assert holders[r.request_id] == 1 and r.worker_id in workers, r
            assert r.attempt >= 1, r
        else:
            assert holders[r.request_id] == 0 and r.worker_id is None, r
    queued = [(stage, rid) for stage, ids in s.queued.items() for rid in ids]
    assert len(queued) == len({rid for _, rid in queued}), queued  # in one queue, once
    assert {rid for _, rid in queued} == {r.request_id for r in s.requests if r.state == "queued"}
    for stage, rid in queued:
        assert reqs[rid].stage == stage
    # a denoise job on a worker that holds decode too reserves nothing: its credit is its own
    must_reserve = {
        r.request_id
        for r in s.requests
        if (r.stage, r.state) == ("decode", "queued")
        or (
            (r.stage, r.state) == ("denoise", "running")
            and "decode" not in workers[r.worker_id].stages  # type: ignore[index]
        )
    }
    assert {r.request_id for r in s.requests if r.reserved} == must_reserve
    assert s.decode_reserved == len(must_reserve)
    assert not set(s.finished) & set(reqs)  # never both done and live/queued


class Harness:
    """An Orchestrator on a VirtualClock; ``feed`` checks invariants after every event
    and that each request surfaces exactly one outcome, followed by its release."""

    def __init__(
        self,
        config: OrchestratorConfig | None = None,
        policy: RoutingPolicy | None = None,
        **options: object,
    ) -> None:
        self.clock = VirtualClock()
        cfg = config or OrchestratorConfig(**options)  # type: ignore[arg-type]
        self.core = Orchestrator(
            cfg, clock=self.clock, policy=policy or create_policy("least_loaded")
        )
        self.outcomes: dict[str, Action] = {}
        self.released: Counter[str] = Counter()
        self.dispatched: list[Dispatch] = []

    def feed(self, event: Event, at: float | None = None) -> list[Action]:
        if at is not None:
            self.clock.set(at)
        actions = self.core.handle(event)
        check_invariants(self.core)
        snap = {w.worker_id: w for w in self.core.snapshot().workers}
        for i, a in enumerate(actions):
            if isinstance(a, Dispatch):
                w = snap[a.worker_id]  # dispatched only against a credit
                assert w.held <= w.advertised and a.item.request_id in w.running, (a, w)
                self.dispatched.append(a)
            elif isinstance(a, TERMINAL):
                assert a.request_id not in self.outcomes, ("second outcome", a)
                self.outcomes[a.request_id] = a
                nxt = actions[i + 1] if i + 1 < len(actions) else None
                assert isinstance(nxt, ReleasePayloads) and nxt.request_id == a.request_id
            elif isinstance(a, ReleasePayloads):
                self.released[a.request_id] += 1
                assert self.released[a.request_id] == 1
        return actions

    def advance(self, seconds: float) -> list[Action]:
        self.clock.advance(seconds)
        return self.feed(Tick())

    def worker(self, wid: str, stage: str, credits: int = 1, **labels: str) -> list[Action]:
        acts = self.feed(Register(wid, stage, credits, dict(labels)))
        assert not any(type(a).__name__ == "Rejected" for a in acts), acts
        return acts

    def finish(self, d: Dispatch, output: bytes | None = None) -> list[Action]:
        item = d.item
        out = output if output is not None else f"{item.stage}:{item.request_id}".encode()
        return self.feed(ItemDone(d.worker_id, item.request_id, item.stage, item.attempt, out))

    def running(self) -> list[Dispatch]:
        """The dispatch of every item running now, oldest first."""
        live = {(r.request_id, r.attempt) for r in self.core.snapshot().requests if r.worker_id}
        return [
            d
            for d in self.dispatched
            if (d.item.request_id, d.item.attempt) in live and self._current(d)
        ]

    def _current(self, d: Dispatch) -> bool:
        r = next(r for r in self.core.snapshot().requests if r.request_id == d.item.request_id)
        return r.stage == d.item.stage and r.worker_id == d.worker_id

    def drain(self, step: float = 0.0) -> None:
        """Finish running items, oldest first, until no request is live."""
        while self.core.snapshot().requests:
            running = self.running()
            assert running, ("stuck", self.core.snapshot())
            self.clock.advance(step)
            self.finish(running[0])


def only(actions: list[Action], kind: type[A]) -> list[A]:
    return [a for a in actions if isinstance(a, kind)]


def one(actions: list[Action], kind: type[A]) -> A:
    found = only(actions, kind)
    assert len(found) == 1, (kind.__name__, actions)
    return found[0]

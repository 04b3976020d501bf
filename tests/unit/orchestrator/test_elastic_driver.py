"""elastic.Elastic on the real core under a virtual clock: a planner's decisions become
Reassign / Drain events and provisioner calls, and stage changes are recorded."""

from __future__ import annotations

import pytest

from mooncake_diffusion.orchestrator import (
    Action,
    Dispatch,
    Event,
    ItemDone,
    LoadStages,
    Orchestrator,
    OrchestratorConfig,
    RegisterWorker,
    Submit,
    VirtualClock,
    WorkerRemoved,
)
from mooncake_diffusion.orchestrator.elastic.contract import Move, Retire
from mooncake_diffusion.orchestrator.elastic.driver import Elastic, pool_sizes
from mooncake_diffusion.orchestrator.elastic.planners import ReactivePlanner, StaticPlanner

pytestmark = pytest.mark.unit


class Provisioned:
    """Records the provisioner calls (the protocol's two methods)."""

    def __init__(self) -> None:
        self.added: list[tuple[str, ...]] = []
        self.removed: list[str] = []

    def add(self, stages: tuple[str, ...]) -> str:
        self.added.append(stages)
        return f"new-{len(self.added)}"

    def remove(self, worker_id: str) -> None:
        self.removed.append(worker_id)


class Driver:
    def __init__(self, elastic: Elastic) -> None:
        self.clock = VirtualClock()
        self.core = Orchestrator(OrchestratorConfig(heartbeat_timeout=1e6), clock=self.clock)
        self.el = elastic
        self.actions: list[Action] = []

    def feed(self, ev: Event) -> list[Action]:
        acts = self.core.handle(ev)
        self.el.observe(self.clock.now(), ev, acts)
        self.actions += acts
        return acts

    def done(self, rid: str, stage: str) -> list[Action]:
        """The worker that holds ``rid``'s ``stage`` reports it done."""
        wid = next(
            a.worker_id
            for a in reversed(self.actions)
            if isinstance(a, Dispatch) and (a.item.request_id, a.item.stage) == (rid, stage)
        )
        return self.feed(ItemDone(wid, rid, stage, 1, b"out"))

    def step(self, t: float):
        self.clock.set(t)
        assert self.el.due(t)
        return self.el.step(self.core.snapshot(), t, self.feed)


def fleet(d: Driver) -> None:
    for wid, stage in (("enc-0", "encode"), ("enc-1", "encode"), ("den-0", "denoise")):
        d.feed(RegisterWorker(wid, stage))
    d.feed(RegisterWorker("dec-0", "decode", credits=2))


def test_a_starved_denoise_queue_moves_an_idle_encode_worker_and_the_change_is_recorded():
    seen = []
    d = Driver(Elastic(ReactivePlanner(interval=1.0, hold=1, max_wait=0.5), on_change=seen.append))
    fleet(d)
    for i in range(3):  # each encodes at once; denoise takes one, two wait
        d.feed(Submit(f"v{i}"))
        d.done(f"v{i}", "encode")
    assert pool_sizes(d.core.snapshot()) == {"encode": 2, "denoise": 1, "decode": 1}
    decisions = d.step(2.0)
    assert [type(x) for x in decisions] == [Move] and decisions[0].stages == ("denoise",)
    wid = decisions[0].worker_id
    load = [a for a in d.actions if isinstance(a, LoadStages)]
    assert [(a.worker_id, a.stages) for a in load] == [(wid, ("denoise",))]  # it held nothing
    assert d.el.pending[wid].before == ("encode",)
    assert d.el.window.view(d.core.snapshot(), 2.0).stages["denoise"].incoming == 1
    d.clock.set(3.5)
    d.feed(RegisterWorker(wid, "denoise", stages=("denoise",)))  # loaded: serving again
    assert pool_sizes(d.core.snapshot()) == {"encode": 1, "denoise": 2, "decode": 1}
    assert d.el.counts == {"planner:move": 1} and len(d.el.changes) == 1
    assert [c.seconds for c in seen] == [1.5] and not d.el.pending
    assert seen[0].line() == f"{wid} encode -> denoise in 1.5 s ({decisions[0].reason})"


def test_retire_drains_then_gives_the_worker_back_once_removed():
    prov = Provisioned()
    planner = ReactivePlanner(interval=1.0, hold=1, idle_retire=1, cooldown=0.0)
    d = Driver(Elastic(planner, prov))
    fleet(d)
    decisions = d.step(1.0)
    assert decisions == [Retire("enc-1", "encode idle for 1 intervals")]
    removed = [a for a in d.actions if isinstance(a, WorkerRemoved)]
    assert [a.worker_id for a in removed] == ["enc-1"]  # idle: drained at once
    assert prov.removed == ["enc-1"] and d.el.counts["planner:retire"] == 1


def test_static_changes_nothing_and_refused_decisions_are_counted():
    d = Driver(Elastic(StaticPlanner(interval=1.0)))
    fleet(d)
    # never due, so the service never builds it a view (a snapshot of the fleet)
    assert not d.el.due(1.0) and not d.el.due(60.0) and d.el.next_at() is None
    assert d.el.step(d.core.snapshot(), 1.0, d.feed) == []  # asked anyway: nothing

    class Bogus:
        interval = 1.0

        def plan(self, view):
            return [Move("nobody", ("denoise",), "test")]

    d = Driver(Elastic(Bogus()))
    fleet(d)
    d.step(1.0)
    assert d.el.counts == {"planner:move": 1, "planner:refused": 1} and not d.el.pending

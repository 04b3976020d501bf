"""PlanWindow: the planner's view built from the real core's snapshot and a window."""

from __future__ import annotations

import pytest

from mooncake_diffusion.orchestrator import (
    ItemDone,
    Orchestrator,
    OrchestratorConfig,
    RegisterWorker,
    Submit,
    VirtualClock,
)
from mooncake_diffusion.orchestrator.elastic.view import PlanWindow

pytestmark = pytest.mark.unit


class Driven:
    """The real core under a virtual clock, every event recorded in a window."""

    def __init__(self, window: float = 10.0) -> None:
        self.clock = VirtualClock()
        self.core = Orchestrator(OrchestratorConfig(heartbeat_timeout=1e6), clock=self.clock)
        self.window = PlanWindow(window=window, history=4, start=0.0)

    def feed(self, ev):
        actions = self.core.handle(ev)
        self.window.observe(self.clock.now(), ev, actions)
        return actions

    def at(self, t: float):
        self.clock.set(t)
        return self

    def view(self):
        return self.window.view(self.core.snapshot(), self.clock.now())


def test_queues_workers_and_waits_per_stage():
    d = Driven()
    d.feed(RegisterWorker("enc-0", "encode"))
    d.feed(RegisterWorker("den-0", "denoise"))
    d.feed(RegisterWorker("dec-0", "decode", credits=2))
    for i in range(3):
        d.at(float(i)).feed(Submit(f"r{i}", slo_class="batch" if i else "interactive"))
    v = d.at(5.0).view()
    enc = v.stages["encode"]
    assert (enc.workers, enc.credits, enc.free) == (1, 1, 0)
    assert enc.queued == {"batch": 2}  # r0 runs, r1 and r2 wait
    assert enc.oldest_wait == pytest.approx(4.0)  # r1 since t=1
    assert v.stages["decode"].credits == 2 and v.stages["denoise"].queued == {}
    assert v.stages["encode"].busy == 1.0 and v.stages["denoise"].busy == 0.0


def test_arrivals_are_whole_buckets_oldest_first_and_attainment_counts_misses():
    d = Driven(window=10.0)
    for wid, stage in (("e", "encode"), ("n", "denoise"), ("c", "decode")):
        d.feed(RegisterWorker(wid, stage, credits=8))
    assert d.at(5.0).view().arrivals == ()  # no whole bucket yet: no false trend
    for i, t in enumerate([11.0, 21.0, 22.0, 31.0, 32.0, 33.0]):
        d.at(t).feed(Submit(f"r{i}", deadline=t + 5.0))
    v = d.at(40.0).view()
    assert v.arrivals == pytest.approx((0.0, 0.1, 0.2, 0.3))  # (0,10] (10,20] (20,30] (30,40]
    assert v.attainment is None
    # r5: encode at 33 -> 41 (in time? no: deadline 38), through all three stages
    for t, stage in ((41.0, "encode"), (42.0, "denoise"), (43.0, "decode")):
        d.at(t).feed(
            ItemDone({"encode": "e", "denoise": "n", "decode": "c"}[stage], "r5", stage, 1)
        )
    v = d.at(44.0).view()
    assert v.attainment == 0.0
    assert v.stages["denoise"].done == 1
    assert v.stages["denoise"].service == pytest.approx(1.0)  # dispatched 41, done 42
    assert v.stages["encode"].service == pytest.approx(8.0)  # dispatched 33, done 41
    assert d.at(60.0).view().stages["encode"].done == 0  # out of the window


def test_busy_is_the_mean_over_the_window_of_the_samples_views_took():
    d = Driven(window=10.0)
    d.feed(RegisterWorker("e", "encode", credits=2))
    d.at(1.0).view()  # idle sample
    d.at(2.0).feed(Submit("r0"))
    assert d.at(3.0).view().stages["encode"].busy == pytest.approx(0.25)  # (0 + 0.5) / 2
    assert d.at(20.0).view().stages["encode"].busy == pytest.approx(0.5)  # old ones gone

"""Randomized runs of the real core under the simulator: workers die, results come
late, clients cancel; nothing is lost and nothing completes twice."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
from orch_harness import check_invariants

from mooncake_diffusion.orchestrator import (
    Dispatch,
    OrchestratorConfig,
    Rejected,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    create_policy,
)
from mooncake_diffusion.simulate import SimConfig, Simulation

pytestmark = pytest.mark.unit

TERMINAL = (RequestCompleted, RequestFailed, RequestCancelled)


class Watch:
    """Observer: invariants after every event, and what clients would see."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self.failed_reasons: list[tuple[str, ...]] = []
        self.dispatch_keys: Counter[tuple[str, str, int]] = Counter()
        self.events = 0

    def __call__(self, core, event, actions) -> None:
        self.events += 1
        check_invariants(core)
        for a in actions:
            if isinstance(a, TERMINAL):
                self.outcomes[a.request_id] += 1
            if isinstance(a, RequestFailed):
                self.failed_reasons.append(a.reasons)
            if isinstance(a, ReleasePayloads):
                self.released[a.request_id] += 1
            if isinstance(a, Dispatch):
                self.dispatch_keys[(a.item.request_id, a.item.stage, a.item.attempt)] += 1
            assert not (isinstance(a, Rejected) and a.code == "bad_value"), a


CHAOS = {
    "death_rate": 0.08,
    "failure_rate": 0.03,
    "cancel_share": 0.05,
    "arrival_rate": 1.2,
    "credits": {"encode": 4, "denoise": 1, "decode": 4},
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "affinity"])
def test_random_worker_deaths_lose_nothing_and_complete_nothing_twice(seed, policy):
    watch = Watch()
    sim = Simulation(
        SimConfig(requests=250, seed=seed, **CHAOS),
        OrchestratorConfig(max_attempts=4, heartbeat_timeout=4.0),
        policy=create_policy(policy),
        observer=watch,
    )
    rep = sim.run()
    assert rep.submitted == 250
    assert rep.lost == 0 and rep.duplicate_completions == 0
    assert rep.completed + rep.failed + rep.cancelled == rep.submitted
    assert set(watch.outcomes) == {f"r{i}" for i in range(250)}
    assert max(watch.outcomes.values()) == 1 and max(watch.released.values()) == 1
    assert max(watch.dispatch_keys.values()) == 1  # an attempt number is never reused
    assert all(watch.failed_reasons) and len(watch.failed_reasons) == rep.failed
    # the chaos really happened, and every late result was dropped by its attempt
    assert rep.worker_deaths > 10 and rep.requeued > 10 and rep.late_results > 0
    assert rep.rejected.get("stale_attempt", 0) == rep.late_results
    assert rep.completed > 200
    assert sim.core.snapshot().requests == ()


def test_a_run_is_reproducible_from_its_seed():
    def run(seed: int) -> dict:
        rep = Simulation(SimConfig(requests=200, seed=seed, **CHAOS)).run()
        return msgspec.structs.asdict(msgspec.structs.replace(rep, core_seconds=0.0))

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_without_faults_every_request_completes_once():
    watch = Watch()
    rep = Simulation(SimConfig(requests=300, seed=0), observer=watch).run()
    assert (rep.completed, rep.failed, rep.lost, rep.requeued) == (300, 0, 0, 0)
    assert rep.rejected == {} and rep.worker_deaths == 0
    # a request that skips encode is dispatched twice, otherwise three times
    assert 600 <= rep.dispatches <= 900

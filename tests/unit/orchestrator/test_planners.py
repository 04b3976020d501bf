"""The built-in planners on synthetic views, and their registry."""

from __future__ import annotations

import importlib.metadata

import pytest

from mooncake_diffusion.orchestrator import OrchestratorConfigError
from mooncake_diffusion.orchestrator.core.model import WorkerSnapshot
from mooncake_diffusion.orchestrator.core.registry import NamedRegistry
from mooncake_diffusion.orchestrator.elastic.contract import (
    AddWorker,
    Move,
    Planner,
    PlannerView,
    Retire,
    StageLoad,
)
from mooncake_diffusion.orchestrator.elastic.planners import (
    PLANNER_GROUP,
    PredictivePlanner,
    ReactivePlanner,
    StaticPlanner,
    create_planner,
    holt_forecast,
    known_planners,
    share,
)

pytestmark = pytest.mark.unit

LAYOUT = {"encode": ["enc-0", "enc-1"], "denoise": ["den-0"], "decode": ["dec-0"]}


def worker(wid: str, stage: str, held: int = 0, state: str = "serving") -> WorkerSnapshot:
    return WorkerSnapshot(
        wid,
        stage,
        0,
        {},
        1,
        held,
        1 - held,
        1e9,
        (),
        (stage,),
        state,  # type: ignore[arg-type]
    )


def view(
    now: float,
    queued: dict[str, int] | None = None,
    wait: dict[str, float] | None = None,
    busy: dict[str, float] | None = None,
    layout: dict[str, list[str]] = LAYOUT,
    arrivals: tuple[float, ...] = (),
    service: dict[str, float] | None = None,
    attainment: float | None = None,
) -> PlannerView:
    """A view of ``layout`` (one credit each); a stage with queued items has no free credit."""
    queued, wait, busy, service = queued or {}, wait or {}, busy or {}, service or {}
    workers, stages = [], {}
    for stage, ids in layout.items():
        q = queued.get(stage, 0)
        held = 1 if q else 0
        workers += [worker(w, stage, held) for w in ids]
        stages[stage] = StageLoad(
            workers=len(ids),
            incoming=0,
            credits=len(ids),
            free=0 if q else len(ids),
            queued={"batch": q} if q else {},
            oldest_wait=wait.get(stage, 0.0),
            busy=busy.get(stage, 1.0 if q else 0.0),
            done=3 if stage in service else 0,
            service=service.get(stage),
        )
    return PlannerView(now, 10.0, stages, tuple(workers), arrivals, attainment)  # type: ignore[arg-type]


def run(planner: Planner, views: list[PlannerView]) -> list[list]:
    return [planner.plan(v) for v in views]


# ----------------------------------------------------------------------------- reactive
def test_a_mix_shift_to_videos_moves_an_idle_encode_worker_to_denoise_after_hold_intervals():
    p = ReactivePlanner(interval=2.0, hold=2)
    images = view(0.0, busy={"encode": 0.5, "denoise": 0.5, "decode": 0.3})
    videos = [
        view(t, queued={"denoise": 4}, wait={"denoise": 1.0 + t}, busy={"encode": 0.05})
        for t in (2.0, 4.0)
    ]
    first, second, third = run(p, [images, *videos])
    assert first == [] and second == []  # once is not enough: hysteresis
    assert third == [Move("enc-0", ("denoise",), "queued denoise 4, waited 5.0 s")]


def test_steady_load_or_a_one_off_spike_changes_nothing():
    p = ReactivePlanner(interval=2.0, hold=3)
    steady = view(0.0, busy={"encode": 0.6, "denoise": 0.9, "decode": 0.5})
    spike = view(2.0, queued={"denoise": 3}, wait={"denoise": 4.0})
    out = run(p, [steady, steady, spike, steady, spike, spike, steady])
    assert all(d == [] for d in out)


def test_bounds_never_empty_a_pool_and_hold_to_max_changes_and_cooldown():
    p = ReactivePlanner(interval=1.0, hold=1, cooldown=100.0, max_changes=1)
    starved = {"denoise": 9, "decode": 9}
    waits = {"denoise": 9.0, "decode": 8.0}
    out = run(p, [view(t, queued=starved, wait=waits) for t in (1.0, 2.0, 3.0)])
    # one change per call, to the most starved stage; a moved worker cools down
    assert [[(d.worker_id, d.stages) for d in ds] for ds in out] == [
        [("enc-0", ("denoise",))],
        [("enc-1", ("denoise",))],
        [],
    ]
    # the last worker of a stage is never taken
    one = {"encode": ["enc-0"], "denoise": ["den-0"], "decode": ["dec-0"]}
    p = ReactivePlanner(interval=1.0, hold=1)
    assert run(p, [view(t, starved, waits, layout=one) for t in (1.0, 2.0)]) == [[], []]
    # a donor with queued items is never taken from, even when it is the only donor
    p = ReactivePlanner(interval=1.0, hold=1)
    both = view(1.0, queued={"denoise": 9, "encode": 1}, wait={"denoise": 9.0})
    assert p.plan(both) == []


def test_a_stage_with_no_worker_and_queued_items_is_served_first():
    layout = {"encode": ["enc-0", "enc-1"], "denoise": ["den-0"], "decode": []}
    v = view(1.0, queued={"decode": 1}, layout=layout)
    assert ReactivePlanner(hold=1).plan(v)[0].stages == ("decode",)


def test_missed_slos_halve_the_wait_it_tolerates():
    q, w = {"denoise": 1}, {"denoise": 1.5}
    assert ReactivePlanner(hold=1, max_wait=2.0).plan(view(1.0, q, w, attainment=1.0)) == []
    moved = ReactivePlanner(hold=1, max_wait=2.0).plan(view(1.0, q, w, attainment=0.5))
    assert [type(d) for d in moved] == [Move]


def test_flex_workers_holding_every_stage_are_never_moved():
    p = ReactivePlanner(hold=1)
    v = view(1.0, queued={"denoise": 5}, wait={"denoise": 9.0})
    flex = tuple(
        WorkerSnapshot(w.worker_id, w.stage, 0, {}, 1, 0, 1, 1e9, (), ("encode", "denoise"))
        if w.stage == "encode"
        else w
        for w in v.workers
    )
    assert p.plan(PlannerView(v.now, v.window, v.stages, flex, (), None)) == []


def test_with_a_provisioner_it_adds_when_no_donor_and_retires_what_stays_idle():
    layout = {"encode": ["enc-0"], "denoise": ["den-0"], "decode": ["dec-0", "dec-1"]}
    p = ReactivePlanner(hold=1, max_workers=5, idle_retire=2, max_changes=2)
    short = view(1.0, queued={"denoise": 5}, wait={"denoise": 9.0}, layout=layout)
    # decode is the only donor with two workers: moved, not added
    assert [type(d) for d in p.plan(short)] == [Move]
    p = ReactivePlanner(hold=1, max_workers=5, idle_retire=2, max_changes=2)
    one_each = {"encode": ["enc-0"], "denoise": ["den-0"], "decode": ["dec-0"]}
    v = view(1.0, queued={"denoise": 5}, wait={"denoise": 9.0}, layout=one_each)
    assert p.plan(v) == [AddWorker(("denoise",), "denoise: queued denoise 5, waited 9.0 s")]
    p = ReactivePlanner(hold=1, idle_retire=2, cooldown=0.0)
    idle = view(1.0, layout=layout)
    assert p.plan(idle) == []
    assert p.plan(idle) == [Retire("dec-1", "decode idle for 2 intervals")]


def test_the_same_views_give_the_same_decisions():
    views = [
        view(float(t), queued={"denoise": t % 4}, wait={"denoise": float(t % 5)}) for t in range(40)
    ]
    assert run(ReactivePlanner(hold=2, cooldown=5.0), views) == run(
        ReactivePlanner(hold=2, cooldown=5.0), views
    )


# ----------------------------------------------------------------------------- predictive
SERVICE = {"encode": 0.2, "denoise": 4.0, "decode": 0.5}


def test_predictive_grows_denoise_on_a_rising_trend_before_any_queue_builds():
    layout = {"encode": ["enc-0", "enc-1", "enc-2"], "denoise": ["den-0"], "decode": ["dec-0"]}
    p = PredictivePlanner(interval=5.0, hold=2, horizon=20.0)
    flat = view(0.0, layout=layout, arrivals=(0.05, 0.05, 0.05), service=SERVICE)
    rising = [
        view(t, layout=layout, arrivals=(0.05, 0.1, 0.2, 0.3), service=SERVICE) for t in (5, 10)
    ]
    out = run(p, [flat, *rising])
    assert out[0] == [] and out[1] == []
    assert len(out[2]) == 1 and isinstance(out[2][0], Move)
    assert out[2][0].stages == ("denoise",) and out[2][0].worker_id == "enc-0"
    assert all(v.stages["denoise"].queued == {} for v in rising)  # no queue yet
    assert p.targets["denoise"] > 1
    steady = PredictivePlanner(interval=5.0, hold=2, horizon=20.0)
    assert all(d == [] for d in run(steady, [flat] * 6))  # enough for a flat rate: no churn


def test_predictive_staffs_a_stage_left_without_workers():
    layout = {"encode": ["enc-0", "enc-1"], "denoise": ["den-0"], "decode": []}
    p = PredictivePlanner(hold=1, service_times=SERVICE)
    out = p.plan(view(1.0, layout=layout, arrivals=(0.1, 0.1)))
    assert [(d.worker_id, d.stages) for d in out] == [("enc-0", ("decode",))]


def test_predictive_without_a_service_time_or_arrivals_does_nothing():
    p = PredictivePlanner(hold=1)
    assert p.plan(view(1.0, arrivals=(1.0, 2.0, 3.0))) == []  # nothing measured or given
    p = PredictivePlanner(hold=1, service_times=SERVICE)
    assert p.plan(view(1.0)) == []  # no arrivals: nothing to size


def test_holt_forecast_and_share():
    assert holt_forecast((), 0.5, 0.3, 2) == 0.0
    assert holt_forecast((1.0, 1.0, 1.0), 0.5, 0.3, 4) == pytest.approx(1.0)
    assert holt_forecast((1.0, 2.0, 3.0, 4.0), 0.5, 0.3, 1) == pytest.approx(5.0)
    assert holt_forecast((4.0, 3.0, 2.0, 1.0), 0.5, 0.3, 10) == 0.0  # never negative
    assert share({"encode": 1.0, "denoise": 8.0, "decode": 1.0}, 5, 1) == {
        "encode": 1,
        "denoise": 3,
        "decode": 1,
    }
    assert share({"encode": 0.0, "denoise": 0.0}, 4, 1) == {}
    assert share({"encode": 1.0, "denoise": 1.0}, 1, 1) == {"encode": 1, "denoise": 1}


# ----------------------------------------------------------------------------- registry
def test_registry_builds_the_builtins_and_is_strict():
    assert {"static", "reactive", "predictive"} <= set(known_planners())
    assert isinstance(create_planner("static"), StaticPlanner)
    assert create_planner("static").plan(view(1.0, queued={"denoise": 9})) == []
    assert create_planner("reactive", interval=3.0).interval == 3.0
    with pytest.raises(OrchestratorConfigError, match=r"unknown planner .nope.; known: .*reactive"):
        create_planner("nope")
    with pytest.raises(OrchestratorConfigError, match="rejects options"):
        create_planner("static", bogus=1)


def test_the_package_declares_its_builtins_as_entry_points():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=PLANNER_GROUP)}
    assert eps["reactive"] == "mooncake_diffusion.orchestrator.elastic.planners:ReactivePlanner"
    clash = NamedRegistry(
        "planner",
        "plan",
        PLANNER_GROUP,
        {"reactive": "mooncake_diffusion.orchestrator.elastic.planners:ReactivePlanner"},
        lambda: [importlib.metadata.EntryPoint("reactive", "other:Planner", PLANNER_GROUP)],
    )
    with pytest.raises(OrchestratorConfigError, match="registered twice"):
        clash.known()

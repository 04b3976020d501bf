"""Built-in planners and their registry (the contract is ``contract.py``).

    planner = create_planner("reactive", interval=2.0)
    for d in planner.plan(view): ...           # Move / AddWorker / Retire

Built-ins: ``static`` (never changes anything), ``reactive`` (queues, waits and
SLO attainment: moves a worker from the least-loaded stage to the most starved
one), ``predictive`` (forecasts the arrival rate with a linear trend and sizes
each pool from the stage's measured service time). Other packages add planners
through the entry-point group ``mooncake_diffusion.planners`` (``name =
"module:Class"``) or ``register_planner``; the registry is as strict as the
routing policies' (``registry.NamedRegistry``).

Both movers share the bounds (``Bounds``): a stage must look short of workers
for ``hold`` consecutive calls before it gets one (hysteresis), a moved worker
is not moved again for ``cooldown`` seconds, at most ``max_changes`` decisions
per call, and a donor stage keeps at least ``min_workers`` serving workers and
has nothing queued. They are deterministic: the same views give the same
decisions (ties break by stage order, then worker id); their only state is
what they derived from earlier views and their own decisions. Workers that hold
several stages (a ``flex`` fleet) are never moved: they already serve all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_diffusion.orchestrator.core.model import STAGES, Stage, WorkerSnapshot
from mooncake_diffusion.orchestrator.core.registry import NamedRegistry
from mooncake_diffusion.orchestrator.elastic.contract import (
    AddWorker,
    Decision,
    Move,
    Planner,
    PlannerView,
    Retire,
    StageLoad,
)
from mooncake_diffusion.orchestrator.elastic.view import stages_of
from mooncake_diffusion.orchestrator.errors import OrchestratorConfigError

__all__ = [
    "BUILTIN_PLANNERS",
    "PLANNER_GROUP",
    "Bounds",
    "PredictivePlanner",
    "ReactivePlanner",
    "StaticPlanner",
    "create_planner",
    "known_planners",
    "register_planner",
]

PLANNER_GROUP = "mooncake_diffusion.planners"
BUILTIN_PLANNERS: dict[str, str] = {
    "static": "mooncake_diffusion.orchestrator.elastic.planners:StaticPlanner",
    "reactive": "mooncake_diffusion.orchestrator.elastic.planners:ReactivePlanner",
    "predictive": "mooncake_diffusion.orchestrator.elastic.planners:PredictivePlanner",
}

default_planners: NamedRegistry[Planner] = NamedRegistry(
    "planner", "plan", PLANNER_GROUP, BUILTIN_PLANNERS
)


def register_planner(name: str, target: str) -> None:
    """Add a planner (``"module:Class"``) to the process-wide registry."""
    default_planners.register(name, target)


def known_planners() -> list[str]:
    return default_planners.known()


def create_planner(name: str, **options: Any) -> Planner:
    """A new planner ``name`` built with exactly ``options``; raises ``OrchestratorConfigError``."""
    return default_planners.create(name, **options)


# --------------------------------------------------------------------------- shared
@dataclass(frozen=True)
class Bounds:
    """How far and how fast a planner may change the pools (the module docstring).
    ``max_workers``: the fleet size ``AddWorker`` may grow to (``None``: it never
    adds: a fixed fleet only moves workers); ``idle_retire``: with a
    provisioner, a stage idle (nothing queued, ``busy`` under ``low_busy``) for
    this many consecutive calls gives one worker back (``None``: never)."""

    hold: int = 2
    cooldown: float = 30.0
    max_changes: int = 1
    min_workers: int = 1
    max_workers: int | None = None
    idle_retire: int | None = None
    low_busy: float = 0.1

    def __post_init__(self) -> None:
        if self.hold < 1 or self.max_changes < 0 or self.min_workers < 1:
            raise OrchestratorConfigError(f"bad planner bounds: {self}")
        if not self.cooldown >= 0:
            raise OrchestratorConfigError(f"planner cooldown must be >= 0, got {self.cooldown}")


def _queued(load: StageLoad) -> int:
    return sum(load.queued.values())


def _movable(view: PlannerView, stage: Stage, moved: dict[str, float], cooldown: float) -> list:
    """Serving single-stage workers of ``stage`` out of their cooldown, least held first."""
    ws = [
        w
        for w in view.workers
        if w.state == "serving"
        and stages_of(w) == (stage,)
        and view.now - moved.get(w.worker_id, -math.inf) >= cooldown
    ]
    return sorted(ws, key=lambda w: (w.held, w.worker_id))


class _Mover:
    """Counters and the move step both movers share (state from views and decisions only)."""

    interval: float

    def __init__(self, interval: float, bounds: Bounds | None, **bound_options: Any) -> None:
        if not interval > 0:
            raise OrchestratorConfigError(f"planner interval must be > 0, got {interval}")
        self.interval = interval
        self.bounds = bounds or Bounds(**bound_options)
        self._short: dict[Stage, int] = dict.fromkeys(STAGES, 0)
        self._idle: dict[Stage, int] = dict.fromkeys(STAGES, 0)
        self._moved: dict[str, float] = {}  # worker -> when this planner last moved it
        self._retired: set[str] = set()

    def _step(
        self, view: PlannerView, need: dict[Stage, float], spare: dict[Stage, float], why: Any
    ) -> list[Decision]:
        """``need``: how short each stage is (> 0: short this call); ``spare``: how much
        each could give (> 0: may donate). Moves from the most spare to the most
        short stage that has been short ``hold`` calls in a row, within the bounds."""
        b = self.bounds
        for s in STAGES:
            self._short[s] = self._short[s] + 1 if need[s] > 0 else 0
        live = {w.worker_id for w in view.workers}
        self._moved = {w: t for w, t in self._moved.items() if w in live}
        self._retired &= live
        out: list[Decision] = []
        short = sorted(
            (s for s in STAGES if self._short[s] >= b.hold),
            key=lambda s: (-need[s], STAGES.index(s)),
        )
        fleet = sum(1 for w in view.workers if w.state != "draining")
        for s in short:
            if len(out) >= b.max_changes:
                break
            w = self._donor(view, s, spare)
            if w is not None:
                out.append(Move(w.worker_id, (s,), why(s)))
                self._moved[w.worker_id] = view.now
            elif b.max_workers is not None and fleet < b.max_workers:
                out.append(AddWorker((s,), f"{s}: {why(s)}"))
                fleet += 1
            else:
                continue
            self._short[s] = 0  # hysteresis: the next one waits ``hold`` calls again
        out.extend(self._retire(view, spare, b.max_changes - len(out)))
        return out

    def _donor(
        self, view: PlannerView, to: Stage, spare: dict[Stage, float]
    ) -> WorkerSnapshot | None:
        b = self.bounds
        for s in sorted(STAGES, key=lambda s: (-spare[s], STAGES.index(s))):
            load = view.stages[s]
            if s == to or spare[s] <= 0 or _queued(load) > 0 or self._short[s] > 0:
                continue
            if load.workers - 1 < b.min_workers:
                continue  # never empty a pool requests may need
            ws = _movable(view, s, self._moved, b.cooldown)
            if ws:
                return ws[0]
        return None

    def _retire(self, view: PlannerView, spare: dict[Stage, float], room: int) -> list[Decision]:
        b = self.bounds
        out: list[Decision] = []
        for s in STAGES:
            load = view.stages[s]
            idle = _queued(load) == 0 and load.busy < b.low_busy and spare[s] > 0
            self._idle[s] = self._idle[s] + 1 if idle else 0
            if b.idle_retire is None or room <= 0 or self._idle[s] < b.idle_retire:
                continue
            if load.workers - 1 < b.min_workers:
                continue
            ws = [w for w in _movable(view, s, self._moved, b.cooldown) if w.held == 0]
            ws = [w for w in ws if w.worker_id not in self._retired]
            if ws:
                w = ws[-1]  # the newest id: the one a provisioner most likely added
                out.append(Retire(w.worker_id, f"{s} idle for {self._idle[s]} intervals"))
                self._retired.add(w.worker_id)
                self._idle[s] = 0
                room -= 1
        return out


# --------------------------------------------------------------------------- planners
class StaticPlanner:
    """Never changes anything: the pools stay as their workers registered. It says so
    (``changes_nothing``), so the loop never builds a view for it."""

    changes_nothing = True

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval

    def plan(self, view: PlannerView) -> list[Decision]:
        return []


class ReactivePlanner(_Mover):
    """Moves a worker toward the stage whose queue is starved.

    A stage is short when items wait and no credit of it is free, and either the
    oldest has waited ``max_wait`` seconds (half that while SLO attainment over
    the window is under ``slo_target``), or more than ``depth`` items wait per
    serving-or-incoming worker; a stage with queued items and no worker at all is
    always short. The most short (oldest wait, then depth) gets a worker from
    the least loaded stage (``busy`` plus queued items per worker) with nothing
    queued. Options other than these go to ``Bounds``."""

    def __init__(
        self,
        interval: float = 2.0,
        *,
        max_wait: float = 2.0,
        depth: float = 2.0,
        slo_target: float = 0.9,
        bounds: Bounds | None = None,
        **bound_options: Any,
    ) -> None:
        super().__init__(interval, bounds, **bound_options)
        self.max_wait, self.depth, self.slo_target = max_wait, depth, slo_target

    def plan(self, view: PlannerView) -> list[Decision]:
        wait = self.max_wait
        if view.attainment is not None and view.attainment < self.slo_target:
            wait /= 2
        need: dict[Stage, float] = {}
        spare: dict[Stage, float] = {}
        for s in STAGES:
            load = view.stages[s]
            q = _queued(load)
            have = load.workers + load.incoming
            per = q / max(have, 1)
            starved = q > 0 and (
                have == 0 or (load.free == 0 and (load.oldest_wait >= wait or per > self.depth))
            )
            need[s] = load.oldest_wait + per if starved else 0.0
            spare[s] = 1.0 - (load.busy + per) if load.workers else 0.0
        loads = view.stages

        def why(s: Stage) -> str:
            return f"queued {s} {_queued(loads[s])}, waited {loads[s].oldest_wait:.1f} s"

        return self._step(view, need, spare, why)


class PredictivePlanner(_Mover):
    """Sizes the pools for the arrival rate it forecasts ``horizon`` seconds ahead.

    The forecast is Holt's linear trend (``alpha`` level, ``beta`` trend) over
    ``view.arrivals``. A stage needs ``rate * service / credits per worker /
    utilisation`` workers, with ``service`` its measured dispatch-to-done seconds
    (``StageLoad.service``; until one is measured, ``service_times[stage]`` if
    given, else the stage is left alone), at least ``min_workers``; when the fleet
    is smaller than the sum, it is shared out in proportion to the needs. A stage
    under its target by one or more workers for ``hold`` calls gets one from the
    stage most over its target (nothing moves while every stage has enough).
    Measured service times are smoothed (``alpha``) across calls."""

    def __init__(
        self,
        interval: float = 5.0,
        *,
        horizon: float = 20.0,
        alpha: float = 0.5,
        beta: float = 0.3,
        utilisation: float = 0.8,
        service_times: dict[str, float] | None = None,
        bounds: Bounds | None = None,
        **bound_options: Any,
    ) -> None:
        super().__init__(interval, bounds, **bound_options)
        if not (0 < alpha <= 1 and 0 <= beta <= 1 and 0 < utilisation <= 1 and horizon >= 0):
            raise OrchestratorConfigError("predictive planner: bad alpha/beta/utilisation/horizon")
        self.horizon, self.alpha, self.beta, self.utilisation = horizon, alpha, beta, utilisation
        self._service: dict[str, float] = dict(service_times or {})
        self.targets: dict[Stage, int] = {}
        self.forecast: float = 0.0

    def plan(self, view: PlannerView) -> list[Decision]:
        self.forecast = holt_forecast(
            view.arrivals, self.alpha, self.beta, self.horizon / view.window
        )
        for s in STAGES:
            measured = view.stages[s].service
            if measured is not None:
                old = self._service.get(s)
                self._service[s] = (
                    measured if old is None else self.alpha * measured + (1 - self.alpha) * old
                )
        want: dict[Stage, float] = {}
        for s in STAGES:
            load = view.stages[s]
            service = self._service.get(s)
            if service is None:
                continue
            per_worker = load.credits / load.workers if load.workers else 1.0
            want[s] = self.forecast * service / per_worker / self.utilisation
        fleet = sum(view.stages[s].workers + view.stages[s].incoming for s in want)
        floor = self.bounds.min_workers
        self.targets = {s: max(floor, math.ceil(w - 1e-9)) for s, w in want.items()}
        if sum(self.targets.values()) > fleet:  # not enough for all: share in proportion
            self.targets = share(want, fleet, floor) or self.targets
        need: dict[Stage, float] = {}
        spare: dict[Stage, float] = {}
        for s in STAGES:
            load = view.stages[s]
            have = load.workers + load.incoming
            gap = self.targets[s] - have if s in self.targets else 0
            need[s] = float(gap) if gap >= 1 else 0.0
            spare[s] = float(-gap) if gap <= -1 else 0.0
        rate = self.forecast

        def why(s: Stage) -> str:
            return f"forecast {rate:.2f} req/s wants {self.targets[s]} {s}"

        return self._step(view, need, spare, why)


# --------------------------------------------------------------------------- arithmetic
def holt_forecast(series: Sequence[float], alpha: float, beta: float, ahead: float) -> float:
    """Holt's linear-trend forecast ``ahead`` steps past the last point (>= 0); 0 if empty."""
    if not series:
        return 0.0
    level, trend = series[0], 0.0
    if len(series) > 1:
        trend = series[1] - series[0]
    for x in series[1:]:
        prev = level
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - prev) + (1 - beta) * trend
    return max(0.0, level + ahead * trend)


def share(want: dict[Stage, float], total: int, floor: int) -> dict[Stage, int]:
    """``total`` workers shared among ``want``'s stages in proportion to it, each at
    least ``floor`` (largest remainder; ties by stage order). Deterministic; empty
    when nothing is wanted."""
    stages = [s for s in STAGES if s in want]
    weight = sum(want.values())
    if not stages or weight <= 0:
        return {}  # nothing forecast: nothing to size
    base = dict.fromkeys(stages, floor)
    left = total - floor * len(stages)
    if left <= 0:
        return base
    exact = {s: left * want[s] / weight for s in stages}
    whole = {s: math.floor(exact[s]) for s in stages}
    rest = left - sum(whole.values())
    order = sorted(stages, key=lambda s: (-(exact[s] - whole[s]), STAGES.index(s)))
    for s in order[:rest]:
        whole[s] += 1
    return {s: base[s] + whole[s] for s in stages}

"""The ``elastic`` layout's driver: a planner resizes the pools during a simulated run.

    simulate(MIXED, Layout("elastic", 8, aux=1, planner="reactive"), load=0.8)

The run starts as its static split (``Layout(mode="disaggregated", ...)`` with the
same ``aux`` / ``hosts``). Every ``planner.interval`` virtual seconds the driver
builds a ``PlannerView`` (``orchestrator.elastic.view.PlanWindow``, which observes
every event the core handles) and applies the planner's ``Move`` decisions; the
planner is one of the registry's (``orchestrator.elastic.planners.create_planner``), by
name, with its time constants scaled to the workload (``planner_options``). The
fleet is fixed: ``AddWorker`` and ``Retire`` are counted and not applied.

The planner sees one worker per GPU holding that GPU's stages (a GPU hosting an
encode and a decode worker is one worker with both stages, as a multi-stage
worker registers), so its decisions are about GPUs. A GPU told to move:

1. takes no more work (its workers advertise 0 credits: ``Heartbeat``),
2. finishes what it holds (items already dispatched to it run to their end;
   the emulation does not checkpoint a running denoise job away, which the
   core's ``Reassign`` does: a move waits for that job instead),
3. leaves the pools (``WorkerLost`` while it holds nothing: nothing is requeued),
4. loads the new stages' models for the current mix at ``costs.LOAD_GBPS``
   (what ``memory.ModelCache`` does not already hold; the GPU serves nothing
   meanwhile), and registers its new workers.

This emulates the contract's ``Reassign`` / ``LoadStages`` with the events the
core handles today (the driver, not the core, waits for the GPU to empty).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from mooncake_diffusion.orchestrator.core.model import (
    Heartbeat,
    WorkerLost,
    WorkerSnapshot,
)
from mooncake_diffusion.orchestrator.elastic.contract import AddWorker, Move, Retire
from mooncake_diffusion.orchestrator.elastic.planners import create_planner
from mooncake_diffusion.orchestrator.elastic.view import PlanWindow
from mooncake_diffusion.simulate.costs import LOAD_GBPS

#: ``model.Workload`` and ``gpus._Gpu`` are typed loosely, as ``cluster._Sim`` must be
#: (``cluster`` imports this module: tests/unit/test_layout.py forbids the cycle)
Workload = Any
_Gpu = Any
_Sim = Any

__all__ = ["Elastic", "planner_options", "pool_of"]


def planner_options(name: str, workload: Workload) -> dict[str, Any]:
    """The planner's time constants, scaled to the workload: ``interval`` half the
    mean isolated request time of the first mix (at least 1 s), a moved GPU not
    moved again for 6 intervals, ``reactive`` starved after one interval's wait,
    ``predictive`` forecasting 4 intervals ahead."""
    t = max(1.0, workload._mean(workload.kinds) / 2)
    opts: dict[str, Any] = {"interval": t, "cooldown": 6 * t}
    if name == "reactive":
        opts["max_wait"] = t
    elif name == "predictive":
        opts["horizon"] = 4 * t
    return opts


def pool_of(stages: tuple[str, ...]) -> str:
    """The GPU pool a stage set makes: ``denoise``, ``host`` (DiT plus E and/or V:
    they yield at step boundaries) or ``aux`` (Encode and/or Decode)."""
    if "denoise" in stages:
        return "denoise" if stages == ("denoise",) else "host"
    return "aux"


class Elastic:
    """Runs the planner on ``sim`` (a ``cluster._Sim``) and carries out its moves."""

    def __init__(self, sim: _Sim, planner: str) -> None:
        self.sim = sim
        self.name = planner
        self.options = planner_options(planner, sim.o.workload)
        self.planner = create_planner(planner, **self.options)
        self.window = PlanWindow(window=2 * self.planner.interval, history=6, start=0.0)
        self.decisions = 0
        self.ignored = 0  # AddWorker / Retire (fixed fleet) and moves of busy GPUs
        self.load_s = 0.0  # GPU-seconds spent loading for stage changes
        sim._at(self.planner.interval, "plan", None)

    # ------------------------------------------------------------ planning
    def view_snapshot(self) -> Any:
        """The core's snapshot with one worker per GPU (its workers merged) and one
        credit per GPU: held while the GPU runs or has items waiting on it (the
        workers' credits in the core are receive slots, not parallelism)."""
        sim = self.sim
        snap = sim.cells[0].core.snapshot()
        by_wid = {w.worker_id: w for w in snap.workers}
        merged = []
        for seq, g in enumerate(sim.gpus):
            ws = [by_wid[wid] for wid in g.wids if wid in by_wid]
            busy = g.running is not None or bool(g.queue)
            stages = g.stages if g.state != "loading" else g.target
            if not stages:
                continue
            merged.append(
                WorkerSnapshot(
                    g.name,
                    stages[0],  # type: ignore[arg-type]
                    seq,
                    {"gpu": g.name, "node": g.node},
                    1,  # a GPU is one serial executor: one credit, busy or free
                    int(busy),
                    int(not busy and g.state == "serving"),
                    min((w.expires_at for w in ws), default=math.inf),
                    tuple(r for w in ws for r in w.running),
                    stages=stages,  # type: ignore[arg-type]
                    state=g.state,  # type: ignore[arg-type]
                )
            )
        return msgspec.structs.replace(snap, workers=tuple(merged))

    def plan(self) -> None:
        sim = self.sim
        now = sim.clock.now()
        view = self.window.view(self.view_snapshot(), now)
        for d in self.planner.plan(view):
            self.decisions += 1
            if isinstance(d, (AddWorker, Retire)):
                self.ignored += 1
                continue
            assert isinstance(d, Move)
            gpu = sim.gpu_of.get(d.worker_id)
            if gpu is None or gpu.state != "serving" or tuple(d.stages) == gpu.stages:
                self.ignored += 1
                continue
            self.change(gpu, tuple(d.stages))
        o = sim.o
        more = sim.completed < sim.submitted or (
            now < o.horizon if o.closed is None else sim.scheduled < o.closed[1]
        )
        if more:
            sim._at(now + self.planner.interval, "plan", None)

    # ------------------------------------------------------------ a stage change
    def change(self, gpu: _Gpu, stages: tuple[str, ...]) -> None:
        sim = self.sim
        cell = sim.cells[0]
        gpu.state, gpu.target = "changing", stages
        self.window.targets[gpu.name] = stages  # type: ignore[assignment]
        sim.stage_changes.append((sim.clock.now(), gpu.name, gpu.stages, stages))
        for wid in gpu.wids:
            sim._feed(cell, Heartbeat(wid, credits=0))
        self.idle(gpu)

    def idle(self, gpu: _Gpu) -> None:
        """Called whenever ``gpu`` may have emptied: a changing GPU leaves and loads."""
        if gpu.state != "changing" or gpu.running is not None or gpu.queue:
            return
        sim = self.sim
        cell = sim.cells[0]
        for wid in gpu.wids:
            if cell.workers[wid].stage == "denoise":
                cell.n_denoise -= 1
            sim._feed(cell, WorkerLost(wid, "stage change"))
        gpu.wids, gpu.stages = [], ()
        gpu.state = "loading"
        gpu.pool = pool_of(gpu.target)
        gb = 0.0
        if gpu.cache is not None:
            gpu.stages = gpu.target  # what the budget and the models are computed for
            gpu.cache.rebudget(sim._budget(gpu))
            gb = self._load(gpu)
            gpu.stages = ()
        took = gb / LOAD_GBPS
        self.load_s += took
        sim._at(sim.clock.now() + took, "loaded", gpu)

    def _load(self, gpu: _Gpu) -> float:
        """Load the new stages' models for the current mix (most frequent kind first)
        while they fit beside one another; returns the GB loaded."""
        sim = self.sim
        w = sim.o.workload
        now = sim.clock.now()
        mix = w.kinds if w.later is None or now < w.shift_at * sim.o.horizon else w.later
        cache = gpu.cache
        assert cache is not None
        taken: list[Any] = []
        gb = 0.0
        for k, _ in sorted(mix, key=lambda ks: -ks[1]):
            models = [m for m in sim._gpu_models(gpu, [k]) if m not in taken]
            if sum(g for _, g in taken + models) > cache.budget:
                break
            gb += cache.need(models)
            taken += models
        return gb

    def loaded(self, gpu: _Gpu) -> None:
        sim = self.sim
        cell = sim.cells[0]
        gpu.changes += 1
        stages = gpu.target
        gpu.state = "serving"
        den = sum("denoise" in g.stages for g in sim.gpus) + ("denoise" in stages)
        dec = sum("decode" in g.stages for g in sim.gpus) + ("decode" in stages)
        idx = gpu.name[1:]
        slots = math.ceil(den / max(1, dec)) + 2
        for st in stages:
            credits = slots if st == "decode" else 1
            sim._register(cell, f"{st[:3]}-{idx}-{gpu.changes}", st, gpu, credits)
        self.window.targets.pop(gpu.name, None)
        # every decode worker re-advertises its receive slots for the new pool sizes (as
        # the static build sizes them), so decode reservations never throttle denoise
        for g in sim.gpus:
            if g is gpu or g.state != "serving":
                continue
            for wid in g.wids:
                if cell.workers[wid].stage == "decode":
                    sim._feed(cell, Heartbeat(wid, credits=slots))

"""The planner contract: how many workers each stage has, decided from the core's state.

A planner is pure and deterministic: given the same ``PlannerView`` sequence it
returns the same decisions. A driver (the service, or the simulator in virtual
time) calls it every ``planner.interval`` seconds:

    view = PlannerView(...)                 # built by the driver from the core and a window
    for d in planner.plan(view):
        Move      -> core.handle(Reassign(d.worker_id, d.stages, d.reason))
        AddWorker -> provisioner.add(d.stages)  (the new worker registers itself)
        Retire    -> core.handle(Drain(d.worker_id, d.reason)); once WorkerRemoved
                     says it is drained, provisioner.remove(d.worker_id)

Planners are named in a registry like the routing policies (entry-point group
``mooncake_diffusion.planners``). A planner must bound its own changes per
call and keep hysteresis (it may keep state between calls, derived only from
the views it was given). It never sees request contents.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from mooncake_diffusion.orchestrator.core.model import Stage, WorkerSnapshot

__all__ = [
    "AddWorker",
    "Decision",
    "Move",
    "Planner",
    "PlannerView",
    "Provisioner",
    "Retire",
    "StageLoad",
]


class StageLoad(msgspec.Struct, frozen=True):
    """One stage, now. ``workers``: serving workers that hold it; ``incoming``:
    workers changing or loading toward it; ``credits`` / ``free``: advertised and
    free credits of its workers; ``queued``: items waiting, by SLO class;
    ``oldest_wait``: seconds the oldest waiting item has waited (0 if none);
    ``busy``: the mean fraction of its workers' credits held over the window;
    ``done``: its items finished over the window; ``service``: their mean seconds
    from dispatch to done (``None`` if none finished), what a predictive planner
    sizes pools from."""

    workers: int
    incoming: int
    credits: int
    free: int
    queued: dict[str, int]
    oldest_wait: float
    busy: float
    done: int = 0
    service: float | None = None


class PlannerView(msgspec.Struct, frozen=True):
    """What a planner reads. ``arrivals``: submissions per second in each of the
    last windows, oldest first (each ``window`` seconds long); ``attainment``:
    the fraction of requests finished in the last window that met their deadline
    (``None`` if none finished)."""

    now: float
    window: float
    stages: dict[Stage, StageLoad]
    workers: tuple[WorkerSnapshot, ...]
    arrivals: tuple[float, ...]
    attainment: float | None


class Move(msgspec.Struct, frozen=True, tag=True):
    """Change a live worker's stages (the core's ``Reassign``)."""

    worker_id: str
    stages: tuple[Stage, ...]
    reason: str


class AddWorker(msgspec.Struct, frozen=True, tag=True):
    """Ask the provisioner for one more worker holding ``stages``."""

    stages: tuple[Stage, ...]
    reason: str


class Retire(msgspec.Struct, frozen=True, tag=True):
    """Drain a worker (the core's ``Drain``), then give it back to the provisioner."""

    worker_id: str
    reason: str


Decision = Move | AddWorker | Retire


@runtime_checkable
class Planner(Protocol):
    """Decides stage changes and pool sizes. ``interval``: seconds between calls. A
    planner whose class sets ``changes_nothing = True`` (the static one) is never
    called: its view (a snapshot of every worker) is not built."""

    interval: float

    def plan(self, view: PlannerView) -> list[Decision]: ...


@runtime_checkable
class Provisioner(Protocol):
    """Adds and removes workers. ``add`` starts one (it registers with the core
    itself) and returns the id it will register under; ``remove`` stops one the
    core has drained (or that is already gone) and must be idempotent."""

    def add(self, stages: tuple[Stage, ...]) -> str: ...

    def remove(self, worker_id: str) -> None: ...

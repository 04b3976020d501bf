"""Fault simulation: worker deaths, zombies and cancels around the real core (virtual time).

    report = Simulation(SimConfig(requests=1000, death_rate=0.05, seed=7)).run()
    assert report.lost == 0 and report.duplicate_completions == 0

It plays the clients and the workers: Poisson arrivals (interactive or batch,
embeddings cached or not), workers that heartbeat, take dispatched items and
finish them after a random service time, and sometimes die mid-item. A death
is reported at once by a supervisor (``WorkerLost``) or found by the core's
heartbeat deadline; some dead workers' results still arrive late (zombies),
and every dead worker restarts under the same id. The simulator executes every
action the core returns (``Revoke`` stops an item) and counts what clients
see: ``lost`` (never reached an outcome) and ``duplicate_completions`` (an
outcome surfaced twice for one request) must both be 0.

Deterministic for a given seed; no threads. ``observer(core, event, actions)``
runs after every event (tests check invariants there); ``timer`` (e.g.
``time.perf_counter``) measures time spent inside ``core.handle``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from mooncake_diffusion.orchestrator.core.clock import VirtualClock
from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import (
    STAGES,
    Action,
    Cancel,
    Dispatch,
    Event,
    Heartbeat,
    ItemDone,
    ItemFailed,
    OrchestratorConfig,
    RegisterWorker,
    Rejected,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Revoke,
    Submit,
    Tick,
    WorkerLost,
)
from mooncake_diffusion.orchestrator.core.routing import RoutingPolicy
from mooncake_diffusion.simulate.events import EventQueue
from mooncake_diffusion.simulate.metrics import quantile

__all__ = ["SimConfig", "SimReport", "Simulation"]


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated cluster and workload. Times are virtual seconds.

    ``service``: per stage, a uniform (low, high) service time; batch items take
    ``batch_scale`` times longer in denoise and decode. ``death_rate``: chance
    that a dispatch kills its worker mid-item. ``failure_rate``: chance an item
    ends in a retryable ``ItemFailed``. ``cancel_share``: share of requests the
    client cancels at a random time within ``cancel_within`` of submitting.
    """

    requests: int = 1000
    seed: int = 0
    arrival_rate: float = 1.0
    interactive_share: float = 0.7
    cached_share: float = 0.5
    workers: dict[str, int] = msgspec.field(
        default_factory=lambda: {"encode": 2, "denoise": 8, "decode": 3}
    )
    credits: dict[str, int] = msgspec.field(
        default_factory=lambda: {"encode": 4, "denoise": 1, "decode": 2}
    )
    nodes: int = 4
    service: dict[str, tuple[float, float]] = msgspec.field(
        default_factory=lambda: {
            "encode": (0.01, 0.05),
            "denoise": (1.0, 5.0),
            "decode": (0.2, 1.0),
        }
    )
    batch_scale: float = 3.0
    death_rate: float = 0.0
    reported_share: float = 0.5
    zombie_share: float = 0.5
    restart_after: float = 3.0
    heartbeat_interval: float = 1.0
    failure_rate: float = 0.0
    cancel_share: float = 0.0
    cancel_within: float = 10.0
    max_virtual_seconds: float = 1e7


class SimReport(msgspec.Struct, frozen=True):
    """What a run produced. ``lost``: requests with no outcome when the run ended."""

    submitted: int
    completed: int
    failed: int
    cancelled: int
    lost: int
    duplicate_completions: int
    dispatches: int
    requeued: int
    worker_deaths: int
    late_results: int
    rejected: dict[str, int]
    events: int
    virtual_seconds: float
    core_seconds: float
    deadline_met: dict[str, float]
    latency_p50: dict[str, float]
    latency_p99: dict[str, float]


class _Proc:
    """A simulated worker process."""

    __slots__ = ("alive", "credits", "gen", "labels", "stage", "wid")

    def __init__(self, wid: str, stage: str, credits: int, labels: dict[str, str]) -> None:
        self.wid = wid
        self.stage = stage
        self.credits = credits
        self.labels = labels
        self.alive = False  # registered with the core and running
        self.gen = 0  # incarnation; bumped at every restart


class Simulation:
    """One simulated run; call ``run()`` once."""

    def __init__(
        self,
        config: SimConfig,
        orchestrator: OrchestratorConfig | None = None,
        *,
        policy: RoutingPolicy | None = None,
        observer: Callable[[Orchestrator, Event, list[Action]], None] | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.clock = VirtualClock()
        self.core = Orchestrator(orchestrator, clock=self.clock, policy=policy)
        self._observer = observer
        self._timer = timer
        self._rng = random.Random(config.seed)
        self._events = EventQueue(self.clock)
        self._procs: dict[str, _Proc] = {}
        self._revoked: set[tuple[str, str, int]] = set()
        self._outcome: dict[str, str] = {}
        self._submitted: dict[str, tuple[str, float]] = {}
        self._latency: dict[str, list[float]] = {}
        self._met: Counter[str] = Counter()
        self._count: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._wake_at: float | None = None
        self._core_seconds = 0.0

    # ---------------------------------------------------------------- driving
    def _at(self, t: float, kind: str, arg: Any = None) -> None:
        self._events.at(t, kind, arg)

    def _feed(self, ev: Event) -> list[Action]:
        self._count["events"] += 1
        if self._timer is None:
            actions = self.core.handle(ev)
        else:
            t0 = self._timer()
            actions = self.core.handle(ev)
            self._core_seconds += self._timer() - t0
        if self._observer is not None:
            self._observer(self.core, ev, actions)
        for a in actions:
            self._execute(a)
        nd = self.core.next_deadline()
        if nd is not None and (self._wake_at is None or nd < self._wake_at) and not self._done():
            self._wake_at = nd
            self._at(nd, "wake")
        return actions

    def _done(self) -> bool:
        return len(self._outcome) == self.config.requests

    def _execute(self, a: Action) -> None:
        now = self.clock.now()
        if isinstance(a, Dispatch):
            self._count["dispatches"] += 1
            self._start(a, now)
        elif isinstance(a, RequestCompleted | RequestFailed | RequestCancelled):
            rid = a.request_id
            if rid in self._outcome:
                self._count["duplicate_completions"] += 1
                return
            kind = type(a).__name__
            self._outcome[rid] = kind
            if isinstance(a, RequestCompleted):
                cls, t0 = self._submitted[rid]
                self._latency.setdefault(cls, []).append(now - t0)
                self._met[cls] += a.deadline_met
        elif isinstance(a, Revoke):
            self._revoked.add((a.request_id, a.stage, a.attempt))
        elif isinstance(a, Requeued):
            self._count["requeued"] += 1
        elif isinstance(a, Rejected):
            self._rejected[a.code] += 1

    def _start(self, d: Dispatch, now: float) -> None:
        p = self._procs[d.worker_id]
        if not p.alive:
            return  # dead but not yet noticed: the item is lost until the deadline
        c, rng, item = self.config, self._rng, d.item
        lo, hi = c.service[item.stage]
        took = rng.uniform(lo, hi)
        if item.slo_class == "batch" and item.stage != "encode":
            took *= c.batch_scale
        if rng.random() < c.death_rate:
            self._at(now + rng.uniform(0, took), "die", (p.wid, p.gen))
            if rng.random() < c.zombie_share:
                late = now + took + self.core.config.heartbeat_timeout * 1.5
                self._at(late, "late", (p.wid, item))
            return
        fails = rng.random() < c.failure_rate
        self._at(now + took, "finish", (p.wid, p.gen, item, fails))

    # ---------------------------------------------------------------- run
    def run(self) -> SimReport:
        c, rng = self.config, self._rng
        for stage in STAGES:
            for i in range(c.workers.get(stage, 0)):
                labels = {"node": f"n{i % max(1, c.nodes)}", "rail": str(i % 2)}
                wid = f"{stage}-{i}"
                self._procs[wid] = _Proc(wid, stage, c.credits.get(stage, 1), labels)
                self._at(0.0, "restart", wid)
        t = 0.0
        for i in range(c.requests):
            t += rng.expovariate(c.arrival_rate)
            self._at(t, "submit", i)
        kinds = ("submit", "cancel", "wake", "beat", "finish", "late", "die", "restart")
        self._events.run({k: getattr(self, "_ev_" + k) for k in kinds}, c.max_virtual_seconds)
        return self._report()

    def _ev_submit(self, i: int) -> None:
        c, rng = self.config, self._rng
        rid = f"r{i}"
        cls = "interactive" if rng.random() < c.interactive_share else "batch"
        cached = b"emb:" + rid.encode() if rng.random() < c.cached_share else None
        self._submitted[rid] = (cls, self.clock.now())
        self._feed(Submit(rid, cls, params=rid.encode(), cached_embeddings=cached))
        if rng.random() < c.cancel_share:
            self._at(self.clock.now() + rng.uniform(0, c.cancel_within), "cancel", rid)

    def _ev_cancel(self, rid: str) -> None:
        self._feed(Cancel(rid))

    def _ev_wake(self, _: None) -> None:
        self._wake_at = None
        if not self._done():
            self._feed(Tick())

    def _ev_beat(self, arg: tuple[str, int]) -> None:
        p = self._procs[arg[0]]
        if p.alive and p.gen == arg[1] and not self._done():
            self._feed(Heartbeat(p.wid))
            self._at(self.clock.now() + self.config.heartbeat_interval, "beat", arg)

    def _ev_finish(self, arg: tuple[str, int, Any, bool]) -> None:
        wid, gen, item, fails = arg
        p = self._procs[wid]
        if not p.alive or p.gen != gen:
            return  # the worker died meanwhile
        if (item.request_id, item.stage, item.attempt) in self._revoked:
            return
        if fails:
            ev: Event = ItemFailed(wid, item.request_id, item.stage, item.attempt, "sim failure")
        else:
            ev = ItemDone(wid, item.request_id, item.stage, item.attempt, b"out:" + item.params)
        self._feed(ev)

    def _ev_late(self, arg: tuple[str, Any]) -> None:
        wid, item = arg
        self._count["late_results"] += 1
        out = b"out:" + item.params
        self._feed(ItemDone(wid, item.request_id, item.stage, item.attempt, out))

    def _ev_die(self, arg: tuple[str, int]) -> None:
        p = self._procs[arg[0]]
        if not p.alive or p.gen != arg[1]:
            return
        p.alive = False
        self._count["worker_deaths"] += 1
        if self._rng.random() < self.config.reported_share:
            self._feed(WorkerLost(p.wid, "process exited"))
        self._at(self.clock.now() + self.config.restart_after, "restart", p.wid)

    def _ev_restart(self, wid: str) -> None:
        if self._done():
            return
        p = self._procs[wid]
        p.gen += 1
        p.alive = True  # before registering: the core may dispatch to it at once
        actions = self._feed(RegisterWorker(wid, p.stage, p.credits, p.labels))
        if any(isinstance(a, Rejected) for a in actions):
            # the core still has the old incarnation: try again after its deadline passes
            p.alive = False
            self._at(self.clock.now() + self.config.heartbeat_interval, "restart", wid)
            return
        self._at(self.clock.now() + self.config.heartbeat_interval, "beat", (wid, p.gen))

    def _report(self) -> SimReport:
        outcomes = Counter(self._outcome.values())
        lat = self._latency
        return SimReport(
            submitted=len(self._submitted),
            completed=outcomes["RequestCompleted"],
            failed=outcomes["RequestFailed"],
            cancelled=outcomes["RequestCancelled"],
            lost=len(self._submitted) - len(self._outcome),
            duplicate_completions=self._count["duplicate_completions"],
            dispatches=self._count["dispatches"],
            requeued=self._count["requeued"],
            worker_deaths=self._count["worker_deaths"],
            late_results=self._count["late_results"],
            rejected=dict(sorted(self._rejected.items())),
            events=self._count["events"],
            virtual_seconds=self.clock.now(),
            core_seconds=self._core_seconds,
            deadline_met={k: self._met[k] / len(v) for k, v in sorted(lat.items())},
            latency_p50={k: quantile(v, 0.5) for k, v in sorted(lat.items())},
            latency_p99={k: quantile(v, 0.99) for k, v in sorted(lat.items())},
        )

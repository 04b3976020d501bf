"""The orchestrator's Prometheus metrics, on ``prometheus_client``, one registry per service.

    m = ServiceMetrics()                       # owned by one OrchestratorService
    m.queue_wait.labels(stage=s).observe(w)    # the service loop, as things happen
    m.stage_done(stage, run_s, info, sent)     # ditto, when a worker reports Done
    m.sync(counters); m.refresh(...)           # the service loop, per scrape: counters
                                               # from its tallies, gauges from a snapshot
    m.text()                                   # exposition text (format 0.0.4)

Histograms are observed as things happen; counters follow the service's own tallies
and gauges a core snapshot, both brought up to date just before each scrape.
``prometheus_client`` objects are thread-safe, so ``text()`` may run on any thread.
Every name starts with ``mcd_orchestrator_``; ``docs/operations.md`` lists them and
``docs/grafana-dashboard.json`` charts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["LATENCY_BUCKETS", "STAGE_BUCKETS", "ServiceMetrics"]

P = "mcd_orchestrator_"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
_STAGES = ("encode", "denoise", "decode")


class ServiceMetrics:
    """The metric objects of one service (their own ``CollectorRegistry``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.submitted = Counter(P + "requests_submitted", "Accepted requests.", registry=r)
        self.finished = Counter(
            P + "requests_finished", "Finished requests by outcome.", ["outcome"], registry=r
        )
        self.dispatches = Counter(P + "dispatches", "Items sent to workers.", ["stage"], registry=r)
        self.requeues = Counter(
            P + "requeues", "Items sent back to their queue.", ["stage"], registry=r
        )
        self.reruns = Counter(
            P + "reruns",
            "Stages run again because the output they had made was lost, by that stage.",
            ["stage"],
            registry=r,
        )
        self.rejected = Counter(
            P + "rejected", "Events the core rejected, by code.", ["code"], registry=r
        )
        self.driver_stall = Counter(
            P + "driver_stall_seconds",
            "Seconds the driver could not run (its process stopped, a turn that blocked), "
            "taken out of the core's time so that workers are not blamed for them.",
            registry=r,
        )
        self.events = {
            name: Counter(P + name, f"{name.replace('_', ' ').capitalize()}.", registry=r)
            for name in (
                "workers_removed",
                "preemptions",
                "wire_errors",
                "resent",
                "driver_errors",
                "stage_changes",
            )
        }
        self.cache_lookups = Counter(
            P + "cache_lookups", "Encode-stage embedding cache lookups.", ["stage"], registry=r
        )
        self.cache_hits = Counter(
            P + "cache_hits", "Encode-stage embedding cache hits.", ["stage"], registry=r
        )
        self.transfer_bytes = Counter(
            P + "transfer_bytes",
            "Bytes a stage received from the previous one, by path (p2p, samehost, store).",
            ["stage", "path"],
            registry=r,
        )
        self.transfer_seconds = Counter(
            P + "transfer_seconds",
            "Seconds stages spent receiving their inputs, by path (the worker's ``in_s``).",
            ["stage", "path"],
            registry=r,
        )
        self.transfers = Counter(
            P + "transfers", "Stage inputs received, by path.", ["stage", "path"], registry=r
        )
        self.request_seconds = Histogram(
            P + "request_seconds", "Submit to completion.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            P + "dispatch_wait_seconds",
            "Time an item waited in its stage's queue before dispatch.",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.run_seconds = Histogram(
            P + "stage_run_seconds",
            "Dispatch to done, per stage (run time plus the input transfer).",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            P + "queue_depth", "Items waiting per stage.", ["stage"], registry=r
        )
        self.workers = Gauge(P + "workers", "Live workers per stage.", ["stage"], registry=r)
        self.free_credits = Gauge(
            P + "free_credits", "Free receive slots per stage.", ["stage"], registry=r
        )
        self.credits_in_use = Gauge(
            P + "credits_in_use", "Credits held by running items per stage.", ["stage"], registry=r
        )
        self.decode_reserved = Gauge(
            P + "decode_reserved", "Decode credits reserved by denoise jobs.", registry=r
        )
        self.pool_workers = Gauge(
            P + "pool_workers",
            "Serving workers per stage (a worker holding several stages counts in each; "
            "one changing stage or draining counts in none).",
            ["stage"],
            registry=r,
        )
        self.planner_decisions = Counter(
            P + "planner_decisions",
            "The planner's decisions by kind (move, add, retire; refused: the core said no).",
            ["kind"],
            registry=r,
        )
        self.stage_change_seconds = Histogram(
            P + "stage_change_seconds",
            "A stage change, from the worker told to load its new stages to its registration "
            "with them (model load and reconnect).",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.stage_load_seconds = Histogram(
            P + "stage_load_seconds",
            "Seconds a worker spent loading its new stages' models, as it reports them.",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.heartbeat_age = Gauge(
            P + "worker_heartbeat_age_seconds",
            "Seconds since each live worker was last heard from.",
            ["worker_id", "stage"],
            registry=r,
        )
        self.worker_memory = Gauge(
            P + "worker_memory_bytes",
            "What each live worker's connector holds, as of its last beat: registered "
            "(with the Transfer Engine), pool_in_use (receive pool handed out), "
            "late_write (held back: a producer may still write into it).",
            ["worker_id", "kind"],
            registry=r,
        )
        for s in _STAGES:  # every stage's series exists from the start, at 0
            for m in (
                self.dispatches,
                self.requeues,
                self.reruns,
                self.queue_wait,
                self.run_seconds,
            ):
                m.labels(stage=s)
        for o in ("completed", "failed", "cancelled"):
            self.finished.labels(outcome=o)
        for k in ("move", "add", "retire", "refused"):
            self.planner_decisions.labels(kind=k)
        self._seen: dict[str, int] = {}

    def sync(self, counters: Mapping[str, int]) -> None:
        """Bring the counters up to the service's tallies (``submitted``, ``completed``,
        ``dispatched:STAGE``, ``requeued:STAGE``, ``rerun:STAGE``, ``rejected:CODE``, ...)."""
        for key, n in counters.items():
            delta = n - self._seen.get(key, 0)
            if delta <= 0:
                continue
            self._seen[key] = n
            kind, _, arg = key.partition(":")
            if key == "submitted":
                self.submitted.inc(delta)
            elif key in ("completed", "failed", "cancelled"):
                self.finished.labels(outcome=key).inc(delta)
            elif kind == "dispatched":
                self.dispatches.labels(stage=arg).inc(delta)
            elif kind == "requeued":
                self.requeues.labels(stage=arg).inc(delta)
            elif kind == "rerun":
                self.reruns.labels(stage=arg).inc(delta)
            elif kind == "rejected":
                self.rejected.labels(code=arg).inc(delta)
            elif key == "driver_stall_ms":
                self.driver_stall.inc(delta / 1000)
            elif kind == "planner":
                self.planner_decisions.labels(kind=arg).inc(delta)
            elif key in self.events:
                self.events[key].inc(delta)

    def stage_done(
        self, stage: str, run_s: float | None, info: Mapping[str, Any], sent: int
    ) -> None:
        """A stage's item finished: its run time, cache use and how its input arrived
        (``info["in_path"]``; ``sent``: the bytes the previous stage published)."""
        if run_s is not None:
            self.run_seconds.labels(stage=stage).observe(run_s)
        if "cache_hit" in info:
            self.cache_lookups.labels(stage=stage).inc()
            if info["cache_hit"]:
                self.cache_hits.labels(stage=stage).inc()
        path = info.get("in_path")
        if isinstance(path, str) and path:
            self.transfers.labels(stage=stage, path=path).inc()
            self.transfer_bytes.labels(stage=stage, path=path).inc(sent)
            secs = info.get("in_s")
            if isinstance(secs, int | float) and secs >= 0:
                self.transfer_seconds.labels(stage=stage, path=path).inc(secs)

    def refresh(
        self,
        queued: Mapping[str, Iterable[str]],
        workers: Iterable[tuple[str, str, int, float]],
        free_credits: Mapping[str, int],
        decode_reserved: int,
    ) -> None:
        """Set the gauges: ``workers`` as (worker id, stage, credits held, heartbeat age)."""
        held = dict.fromkeys(_STAGES, 0)
        count = dict.fromkeys(_STAGES, 0)
        self.heartbeat_age.clear()
        for wid, stage, n, age in workers:
            held[stage] = held.get(stage, 0) + n
            count[stage] = count.get(stage, 0) + 1
            self.heartbeat_age.labels(worker_id=wid, stage=stage).set(age)
        for s in _STAGES:
            self.queue_depth.labels(stage=s).set(len(list(queued.get(s, ()))))
            self.workers.labels(stage=s).set(count[s])
            self.free_credits.labels(stage=s).set(free_credits.get(s, 0))
            self.credits_in_use.labels(stage=s).set(held[s])
        self.decode_reserved.set(decode_reserved)

    def memory_set(self, reports: Iterable[tuple[str, int, int, int]]) -> None:
        """Set ``worker_memory`` from (worker id, registered, pool in use, late write)
        bytes of the live workers that reported them; the others' series go."""
        self.worker_memory.clear()
        for wid, registered, pool, late in reports:
            self.worker_memory.labels(worker_id=wid, kind="registered").set(registered)
            self.worker_memory.labels(worker_id=wid, kind="pool_in_use").set(pool)
            self.worker_memory.labels(worker_id=wid, kind="late_write").set(late)

    def pool_workers_set(self, pools: Mapping[str, int]) -> None:
        """Set ``pool_workers`` from serving workers per stage (``elastic.driver.pool_sizes``)."""
        for s in _STAGES:
            self.pool_workers.labels(stage=s).set(pools.get(s, 0))

    def text(self) -> str:
        return generate_latest(self.registry).decode()

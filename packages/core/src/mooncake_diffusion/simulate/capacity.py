"""Capacity at SLO: the highest arrival rate a deployment serves within its SLOs.

    base = slo_base([QWEN_1024, FLUX_1024], H100)       # seconds per kind
    cap = capacity_at_slo(IMAGE, Layout("colocated", 8), base=base,
                          slos=(Slo(1.5, 0.9), Slo(1.5, 0.99)), seed=0)
    cap.rate[Slo(1.5, 0.9)]       # requests/s at which 90 % meet 1.5 x their base

As DistServe defines goodput: the SLO of a request is ``scale`` x its base
latency (``slo_base``: its single-request latency alone, the slower of the
colocated and the disaggregated layout on that GPU, so that at scale 1.0 an idle
cluster of either kind meets it), and a deployment's capacity is the highest
mean arrival rate at which at least ``target`` of the requests meet it.

Steady state: each probe is one open-loop run of ``arrivals_n`` arrivals in its
measuring window after a warm-up (``warmup_share`` of the window, and at least
``warmup_min_s``); attainment counts the requests that arrived in the window,
each run to completion, so an overloaded probe reads as low attainment and never
as a shortened one. No admission control.

The search (``search_capacity``) is generic over a probe: it brackets the rate
for each SLO in turn (bisection, reusing every probe already run, since one
probe gives the attainment of every SLO scale: the deadline does not change the
scheduling) until the bracket is narrower than ``rel_tol`` x the upper bound,
then interpolates linearly inside the bracket. The elastic-pool layouts call it
with their own probe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig
from mooncake_diffusion.simulate.arrivals import Arrivals
from mooncake_diffusion.simulate.cluster import simulate
from mooncake_diffusion.simulate.costs import GpuType, RequestKind
from mooncake_diffusion.simulate.model import (
    Layout,
    Mechanisms,
    Memory,
    RunResult,
    Scheduler,
    Workload,
)

__all__ = [
    "Capacity",
    "Slo",
    "attainment",
    "capacity_at_slo",
    "search_capacity",
    "slo_base",
    "steady_horizon",
]


@dataclass(frozen=True)
class Slo:
    """Deadline ``scale`` x the base latency, met by at least ``target`` of requests."""

    scale: float
    target: float = 0.9

    @property
    def label(self) -> str:
        return f"{self.scale:g}x@{self.target:.0%}"


def slo_base(kinds: Iterable[RequestKind], gpu: GpuType) -> dict[str, float]:
    """Per kind, the slower of its single-request latencies colocated and
    disaggregated (one aux GPU) on ``gpu``, nothing cached."""
    out: dict[str, float] = {}
    for kind in kinds:
        w = Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)
        lats = []
        for lay in (Layout("colocated", 2, gpu=gpu), Layout("disaggregated", 2, aux=1, gpu=gpu)):
            (rec,) = simulate(w, lay, closed_loop=(1, 1)).records
            assert rec.done is not None
            lats.append(rec.done - rec.submitted)
        out[kind.name] = max(lats)
    return out


def attainment(result: RunResult, base: Mapping[str, float], scale: float) -> float:
    """Share of the requests that arrived in the run's window whose end-to-end latency
    is within ``scale`` x their kind's base (1.0 when none arrived)."""
    lo, hi = result.window
    arrived = [x for x in result.records if lo <= x.submitted < hi]
    if not arrived:
        return 1.0
    met = sum(
        1
        for x in arrived
        if x.done is not None and x.done - x.submitted <= scale * base[x.kind.name]
    )
    return met / len(arrived)


def steady_horizon(
    rate: float, arrivals_n: int, warmup_share: float, warmup_min_s: float
) -> tuple[float, float]:
    """(horizon, warm-up) seconds for ``arrivals_n`` arrivals after the warm-up."""
    window = arrivals_n / rate
    warm = max(warmup_share * window, warmup_min_s)
    return warm + window, warm


def search_capacity(
    probe: Callable[[float], Mapping[float, float]],
    slos: Sequence[Slo],
    hi: float,
    rel_tol: float = 0.01,
    max_expand: int = 4,
) -> tuple[dict[Slo, float], list[tuple[float, dict[float, float]]]]:
    """Capacity per SLO by bisection over the rate, reusing probes across SLOs.

    ``probe(rate)`` returns the attainment per SLO scale of one run at ``rate``;
    ``hi`` is a first upper bound (doubled up to ``max_expand`` times while every
    request still meets the SLO there). Rate 0 counts as attainment 1. Returns the
    capacities and every probe run, in order."""
    seen: dict[float, dict[float, float]] = {}

    def at(rate: float) -> dict[float, float]:
        if rate not in seen:
            seen[rate] = dict(probe(rate))
        return seen[rate]

    tol = rel_tol * hi
    out: dict[Slo, float] = {}
    for slo in slos:
        ok = [(r, a[slo.scale]) for r, a in seen.items() if a[slo.scale] >= slo.target]
        bad = [(r, a[slo.scale]) for r, a in seen.items() if a[slo.scale] < slo.target]
        lo = max(ok, default=(0.0, 1.0))
        top = min(bad, default=None)
        expand = 0
        while top is None:
            cand = hi * 2**expand
            a = at(cand)[slo.scale]
            if a < slo.target:
                top = (cand, a)
            else:
                lo = max(lo, (cand, a))
                expand += 1
                if expand > max_expand:
                    break
        if top is None:  # met even at the largest rate tried: report that rate
            out[slo] = lo[0]
            continue
        lo = max((p for p in ok if p[0] < top[0]), default=(0.0, 1.0)) if lo[0] >= top[0] else lo
        while top[0] - lo[0] > tol:
            mid = (lo[0] + top[0]) / 2
            a = at(mid)[slo.scale]
            if a >= slo.target:
                lo = (mid, a)
            else:
                top = (mid, a)
        (r0, a0), (r1, a1) = lo, top
        frac = (a0 - slo.target) / (a0 - a1) if a0 > a1 else 0.0
        out[slo] = r0 + frac * (r1 - r0)
    return out, sorted(seen.items())


@dataclass
class Capacity:
    """``rate``: requests/s per SLO; ``per_gpu`` and ``per_usd_hour`` (x3600: requests
    per dollar of GPU time) alike; ``probes``: (rate, attainment per scale) runs;
    ``cannot_fit``: as ``RunResult.cannot_fit``; ``configs``: the core configurations
    the runs used; ``stage_changes`` and ``loaded_gb``: summed over the probes
    (elastic moves begun; weights loaded under ``memory="swap"``)."""

    rate: dict[Slo, float]
    gpus: int
    price_per_hour: float
    probes: list[tuple[float, dict[float, float]]] = field(default_factory=list)
    cannot_fit: list[str] = field(default_factory=list)
    configs: list[OrchestratorConfig] = field(default_factory=list)
    stage_changes: int = 0
    loaded_gb: float = 0.0

    def per_gpu(self, slo: Slo) -> float:
        return self.rate[slo] / self.gpus

    def per_usd_hour(self, slo: Slo) -> float:
        return self.rate[slo] * 3600 / self.price_per_hour


def capacity_at_slo(
    workload: Workload,
    layout: Layout,
    mech: Mechanisms | None = None,
    *,
    base: Mapping[str, float],
    slos: Sequence[Slo],
    seed: int = 0,
    sched: Scheduler | None = None,
    arrivals: Arrivals | None = None,
    arrivals_n: int = 1500,
    warmup_share: float = 0.25,
    warmup_min_s: float | None = None,
    hi_load: float = 1.25,
    rel_tol: float = 0.01,
    memory: Memory | None = None,
) -> Capacity:
    """Capacity of ``layout`` for ``workload`` at each SLO (``search_capacity`` over
    steady-state runs of ``simulate``). ``hi_load``: the first upper bound, as a
    share of the isolated capacity ``gpus / workload.mean_gpu_seconds()``;
    ``warmup_min_s`` defaults to twice the longest kind's base latency; ``memory``
    as ``simulate``'s."""
    kinds = [k for k, _ in workload.kinds + (workload.later or ())]
    warm_min = warmup_min_s if warmup_min_s is not None else 2 * max(base[k.name] for k in kinds)
    scales = sorted({s.scale for s in slos})
    price = [0.0]
    unfit: set[str] = set()
    configs: list[OrchestratorConfig] = []
    moved = [0, 0.0]

    def probe(rate: float) -> dict[float, float]:
        horizon, warm = steady_horizon(rate, arrivals_n, warmup_share, warm_min)
        r = simulate(
            workload,
            layout,
            mech,
            sched=sched,
            rate=rate,
            horizon=horizon,
            warmup=warm,
            arrivals=arrivals,
            seed=seed,
            memory=memory,
        )
        moved[0] += len(r.stage_changes)
        moved[1] += r.loaded_gb
        price[0] = r.price_per_hour
        unfit.update(r.cannot_fit)
        if r.config not in configs:
            configs.append(r.config)
        return {s: attainment(r, base, s) for s in scales}

    hi = hi_load * layout.gpus / workload.mean_gpu_seconds()
    rates, probes = search_capacity(probe, slos, hi, rel_tol)
    return Capacity(
        rates, layout.gpus, price[0], probes, sorted(unfit), configs, int(moved[0]), moved[1]
    )

"""What a run measured: throughput, goodput under SLO, TTFF quantiles, utilisation.

    s = summarize(result)
    s.goodput          # completions within their deadline per second, in the window
    s.p99_ttff         # interactive requests, seconds from submit to first frame
    s.p99_latency      # every request, seconds from submit to its last frame

The window is ``result.window`` (arrivals after the warm-up, up to the horizon):
throughput and goodput count completions inside it, per second of it; latency
quantiles use the requests that arrived in it (each ran to completion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mooncake_diffusion.simulate.model import RunResult

__all__ = ["Summary", "quantile", "summarize"]


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (0.0 for no data)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class Summary:
    requests: int
    throughput: float
    goodput: float
    slo_met: float
    p50_ttff: float
    p99_ttff: float
    p50_latency_batch: float
    p99_latency_batch: float
    p50_latency: float
    p99_latency: float
    utilisation: dict[str, float]
    preemptions: int
    encodes_skipped: int


def summarize(r: RunResult) -> Summary:
    lo, hi = r.window
    span = max(hi - lo, 1e-9)
    done_in = [x for x in r.records if x.done is not None and lo <= x.done < hi]
    arrived = [x for x in r.records if lo <= x.submitted < hi]
    inter = [x for x in arrived if x.kind.slo_class == "interactive" and x.ttff is not None]
    batch = [x for x in arrived if x.kind.slo_class == "batch" and x.done is not None]
    e2e = [x.done - x.submitted for x in arrived if x.done is not None]
    busy_span = max(min(r.horizon, r.makespan), 1e-9)
    util = {pool: r.busy[pool] / (r.pool_gpus[pool] * busy_span) for pool in sorted(r.pool_gpus)}
    return Summary(
        requests=len(r.records),
        throughput=len(done_in) / span,
        goodput=sum(x.met for x in done_in) / span,
        slo_met=sum(x.met for x in arrived) / max(1, len(arrived)),
        p50_ttff=quantile([x.ttff - x.submitted for x in inter], 0.5),  # type: ignore[operator]
        p99_ttff=quantile([x.ttff - x.submitted for x in inter], 0.99),  # type: ignore[operator]
        p50_latency_batch=quantile([x.done - x.submitted for x in batch], 0.5),  # type: ignore[operator]
        p99_latency_batch=quantile([x.done - x.submitted for x in batch], 0.99),  # type: ignore[operator]
        p50_latency=quantile(e2e, 0.5),
        p99_latency=quantile(e2e, 0.99),
        utilisation=util,
        preemptions=sum(x.preemptions for x in r.records),
        encodes_skipped=sum(x.encode_skipped for x in r.records),
    )

"""A cluster simulator on the real orchestrator core (virtual time), for bench/sim.py.

    costs.py    RequestKind and the cited stage times (workloads.md) of each kind
    cluster.py  simulate(): colocated vs disaggregated serving, Mechanisms switches
    metrics.py  summarize(): throughput, goodput under SLO, TTFF quantiles, utilisation

Pure Python over ``mooncake_diffusion.orchestrator``; no torch, no Mooncake.
"""

from mooncake_diffusion.simulate.cluster import (
    Layout,
    Mechanisms,
    RequestRecord,
    RunResult,
    Workload,
    default_aux,
    simulate,
)
from mooncake_diffusion.simulate.costs import (
    FLUX_1024,
    QWEN_1024,
    QWEN_4090,
    TRANSFER_S,
    WAN_720P,
    RequestKind,
)
from mooncake_diffusion.simulate.metrics import Summary, summarize

__all__ = [
    "FLUX_1024",
    "QWEN_1024",
    "QWEN_4090",
    "TRANSFER_S",
    "WAN_720P",
    "Layout",
    "Mechanisms",
    "RequestKind",
    "RequestRecord",
    "RunResult",
    "Summary",
    "Workload",
    "default_aux",
    "simulate",
    "summarize",
]

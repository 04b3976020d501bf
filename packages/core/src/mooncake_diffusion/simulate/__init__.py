"""Simulators on the real orchestrator core, in virtual time.

    events.py   EventQueue: the virtual-time event loop both simulators run on
    faults.py   Simulation: worker deaths, zombies, cancels; counts lost and
                duplicate completions (bench/orchestrator.py, the core's tests)
    costs.py    RequestKind and the cited stage times (workloads.md) of each kind
    cluster.py  simulate(): colocated vs disaggregated serving, Mechanisms switches
                (bench/sim.py)
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
from mooncake_diffusion.simulate.events import EventQueue
from mooncake_diffusion.simulate.faults import SimConfig, SimReport, Simulation
from mooncake_diffusion.simulate.metrics import Summary, summarize

__all__ = [
    "FLUX_1024",
    "QWEN_1024",
    "QWEN_4090",
    "TRANSFER_S",
    "WAN_720P",
    "EventQueue",
    "Layout",
    "Mechanisms",
    "RequestKind",
    "RequestRecord",
    "RunResult",
    "SimConfig",
    "SimReport",
    "Simulation",
    "Summary",
    "Workload",
    "default_aux",
    "simulate",
    "summarize",
]

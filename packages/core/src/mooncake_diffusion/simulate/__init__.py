"""Simulators on the real orchestrator core, in virtual time.

    events.py   EventQueue: the virtual-time event loop both simulators run on
    faults.py   Simulation: worker deaths, zombies, cancels; counts lost and
                duplicate completions (bench/orchestrator.py, the core's tests)
    costs.py    RequestKind, GpuType and the cited stage times, memory and prices
    cluster.py  simulate(): colocated vs disaggregated serving on one Scheduler,
                Mechanisms switches
                (bench/sim.py)
    metrics.py  summarize(): throughput, goodput under SLO, TTFF quantiles, utilisation

Pure Python over ``mooncake_diffusion.orchestrator``; no torch, no Mooncake.
"""

from mooncake_diffusion.simulate.cluster import (
    Layout,
    Mechanisms,
    RequestRecord,
    RunResult,
    Scheduler,
    Workload,
    default_aux,
    simulate,
)
from mooncake_diffusion.simulate.costs import (
    FLUX_1024,
    GPUS,
    H100,
    L40S,
    QWEN_1024,
    QWEN_4090,
    QWEN_4090_50,
    RTX_4090,
    TRANSFER_S,
    WAN_720P,
    GpuType,
    RequestKind,
    placement_penalty,
)
from mooncake_diffusion.simulate.events import EventQueue
from mooncake_diffusion.simulate.faults import SimConfig, SimReport, Simulation
from mooncake_diffusion.simulate.metrics import Summary, summarize

__all__ = [
    "FLUX_1024",
    "GPUS",
    "H100",
    "L40S",
    "QWEN_1024",
    "QWEN_4090",
    "QWEN_4090_50",
    "RTX_4090",
    "TRANSFER_S",
    "WAN_720P",
    "EventQueue",
    "GpuType",
    "Layout",
    "Mechanisms",
    "RequestKind",
    "RequestRecord",
    "RunResult",
    "Scheduler",
    "SimConfig",
    "SimReport",
    "Simulation",
    "Summary",
    "Workload",
    "default_aux",
    "placement_penalty",
    "simulate",
    "summarize",
]

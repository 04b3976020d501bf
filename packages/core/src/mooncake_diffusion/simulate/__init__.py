"""Simulators on the real orchestrator core, in virtual time.

    events.py   EventQueue: the virtual-time event loop both simulators run on
    faults.py   Simulation: worker deaths, zombies, cancels; counts lost and
                duplicate completions (bench/orchestrator.py, the core's tests)
    costs.py    RequestKind, GpuType and the cited stage times, memory and prices
    model.py    Workload, Layout, Mechanisms, Scheduler: what a cluster run takes;
                RunResult, RequestRecord: what it returns
    cluster.py  simulate(): colocated vs disaggregated serving on one Scheduler,
                Mechanisms switches
                (bench/sim.py)
    gpus.py     the simulated GPUs, their routing, and what an item costs on one
                (stage times, model loads): the parts cluster.py runs
    metrics.py  summarize(): throughput, goodput under SLO, TTFF quantiles, utilisation
    arrivals.py Poisson, Bursty (two-state MMPP), Diurnal arrival processes
    capacity.py capacity_at_slo(): the highest rate at which a share of requests
                meets scale x its base latency (the headline metric)
    memory.py   ModelCache: the models a GPU holds under memory="swap"
    elastic.py  the elastic layout's driver: a registry planner moves GPUs between
                stages during a run

Pure Python over ``mooncake_diffusion.orchestrator``; no torch, no Mooncake.
"""

from mooncake_diffusion.simulate.arrivals import Arrivals, Bursty, Diurnal, Poisson
from mooncake_diffusion.simulate.capacity import (
    Capacity,
    Slo,
    attainment,
    capacity_at_slo,
    search_capacity,
    slo_base,
)
from mooncake_diffusion.simulate.cluster import simulate
from mooncake_diffusion.simulate.costs import (
    FLUX_1024,
    GPUS,
    H100,
    L40S,
    LOAD_GBPS,
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
from mooncake_diffusion.simulate.model import (
    Layout,
    Mechanisms,
    RequestRecord,
    RunResult,
    Scheduler,
    Workload,
    default_aux,
)

__all__ = [
    "FLUX_1024",
    "GPUS",
    "H100",
    "L40S",
    "LOAD_GBPS",
    "QWEN_1024",
    "QWEN_4090",
    "QWEN_4090_50",
    "RTX_4090",
    "TRANSFER_S",
    "WAN_720P",
    "Arrivals",
    "Bursty",
    "Capacity",
    "Diurnal",
    "EventQueue",
    "GpuType",
    "Layout",
    "Mechanisms",
    "Poisson",
    "RequestKind",
    "RequestRecord",
    "RunResult",
    "Scheduler",
    "SimConfig",
    "SimReport",
    "Simulation",
    "Slo",
    "Summary",
    "Workload",
    "attainment",
    "capacity_at_slo",
    "default_aux",
    "placement_penalty",
    "search_capacity",
    "simulate",
    "slo_base",
    "summarize",
]

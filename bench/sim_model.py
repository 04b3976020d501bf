"""bench/sim.py's model: the workloads, cells and SLOs it judges, the measurements
it calibrates against, and the statistics that turn per-seed runs into a verdict.

    CELLS, HEADLINE, SLOS     the capacity part's cells (workload x GPU x size) and SLOs
    ARRIVAL_CELLS, COST_CELLS, ABLATION_CELL   the cells the later parts reuse
    LIGHTX2V_*, MEASURED_*    the published numbers the simulator is held against
    Plan                      how much each search runs (seeds, arrivals, tolerance)
    mean_ci, paired, verdict  per-seed ratios, their 95 % interval, win / tie / lose
    memory_report             the weights each GPU role must hold for a whole mix

Constants only and pure functions: nothing here runs the simulator.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    QWEN_1024,
    QWEN_4090,
    RTX_4090,
    WAN_720P,
    GpuType,
    Layout,
    Slo,
    Workload,
)

IMAGE = Workload("image", ((QWEN_1024, 0.5), (FLUX_1024, 0.5)))
VIDEO = Workload("video", ((WAN_720P, 1.0),))
MIXED = Workload("mixed", ((QWEN_1024, 0.45), (FLUX_1024, 0.45), (WAN_720P, 0.10)))
SHIFTING = Workload(
    "shifting", MIXED.kinds, later=((QWEN_1024, 0.35), (FLUX_1024, 0.35), (WAN_720P, 0.30))
)
# LightX2V's Qwen-Image on RTX 4090: no embedding cache in that engine
QWEN4090 = Workload("qwen-4090", ((QWEN_4090, 1.0),), prompt_repeat=0.0, cache_negative=False)
CELLS: tuple[tuple[Workload, GpuType, int], ...] = tuple(
    (w, g, n)
    for w, g in (
        (IMAGE, H100),
        (VIDEO, H100),
        (MIXED, H100),
        (SHIFTING, H100),
        (QWEN4090, RTX_4090),
    )
    for n in (8, 64)
)
HEADLINE = Slo(1.5, 0.9)
SLOS = (HEADLINE, Slo(1.5, 0.99), Slo(1.0, 0.9), Slo(1.25, 0.9), Slo(3.0, 0.9))
SELECT_SEEDS = (1000, 1001, 1002)  # choose the best split on these, judge on others
ARRIVALS_N = 1500  # arrivals per probe in the measuring window, after the warm-up
REL_TOL = 0.01  # bisection stops when the rate bracket is < 1 % of the upper bound
ARRIVAL_CELLS = (("mixed", "h100", 8), ("image", "h100", 64))
COST_CELLS = (("mixed", "h100", 64), ("image", "h100", 64))
ABLATION_CELL = ("mixed", "h100", 64)
MECHS = ("fit_memory", "decode_off_dit", "cross_instance_cache")
# LightX2V blog (docs/sources.md): Qwen-Image-2512 T2I, 100 requests, 8 x RTX 4090.
# (dit GPUs, aux GPUs): measured QPS; the 4-GPU runs and "7:1 centralized" used the
# centralized three-stage queue, the rest the decentralized one.
LIGHTX2V_SPLITS = {
    "8:0": (8, 0, 0.18),
    "4:4": (4, 4, 0.20),
    "5:3": (5, 3, 0.25),
    "6:2": (6, 2, 0.30),
    "7:1": (7, 1, 0.34),
    "7:1 centralized": (7, 1, 0.24),
    "4:0": (4, 0, 0.092),
    "2:2": (2, 2, 0.096),
    "3:1": (3, 1, 0.15),
}
LIGHTX2V_P50 = {"8:0": 22.0, "7:1": 17.0}
# single-request end-to-end seconds on one H100 and Qwen-Image's measured stage shares
MEASURED_E2E = {"qwen-1024": (12.77, 13.10), "flux-1024": (4.30, 6.71), "wan-720p": (1041.5,)}
MEASURED_SHARES = {"qwen-1024": (0.010, 0.962, 0.012)}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}

MEMORY_RULE = (
    "swap: a GPU holds the models of the stages it serves while they fit in 90 % of its "
    "memory less the decode peak it keeps free; an item whose model is not resident "
    "first loads it at load_gbps (evicting the least recently used), the GPU serving "
    "nothing meanwhile; the same rule for colocated, static, flex and elastic; a stage "
    "change loads the new stages' models the same way"
)


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (Student t)."""
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def verdict(ratio: float, half: float) -> str:
    """win / lose when the 95 % CI of the ratio lies above 1.02 / below 0.98, else tie."""
    if math.isnan(ratio):
        return "n/a"
    half = 0.0 if math.isnan(half) else half
    if ratio - half > 1.02:
        return "win"
    if ratio + half < 0.98:
        return "lose"
    return "tie"


def paired(a: list, b: list, key) -> tuple[float, float]:
    """Mean of per-seed ratios key(b) / key(a) and its CI half-width (zero bases skipped)."""
    xs = [key(y) / key(x) for x, y in zip(a, b, strict=True) if key(x) > 0]
    return mean_ci(xs)


class Plan:
    """How much each search runs: seeds that judge, seeds that choose the split,
    arrivals per probe, bisection tolerance."""

    def __init__(
        self, seeds: int, select: int, arrivals_n: int, rel_tol: float, planner: str = "reactive"
    ) -> None:
        self.planner = planner
        self.seeds = list(range(seeds))
        self.select = list(SELECT_SEEDS[:select])
        self.arrivals_n = arrivals_n
        self.rel_tol = rel_tol
        self.probes: list[int] = []


def cell_name(w: Workload, gpu: GpuType, n: int) -> str:
    return f"{w.name}-{n}x{gpu.name}"


def kinds_of(w: Workload) -> list:
    return [k for k, _ in w.kinds + (w.later or ())]


def memory_report(w: Workload, lay: Layout) -> dict[str, Any]:
    """Which GPU holds which weights for the whole mix, and whether it fits its usable
    memory (an untiled decode peak counts once: one decode runs at a time). The
    simulator does not model switching models: a GPU is assumed to hold every model
    of the mix; ``fits`` says whether that assumption is physical."""
    ks = list({k.name: k for k in kinds_of(w)}.values())  # each model once
    enc = sum(k.encoder_gb for k in ks)
    dit = sum(k.dit_gb for k in ks)
    vae = max(k.vae_peak_gb for k in ks)
    roles: dict[str, tuple[float, GpuType]] = {}
    if lay.mode == "colocated":
        roles["colocated"] = (enc + dit + vae, lay.gpu)
    elif lay.aux == 0:
        roles["E+V+DiT host"] = (enc + dit + vae, lay.gpu)
        roles["denoise"] = (dit, lay.gpu)
    else:
        roles["denoise"] = (dit, lay.gpu)
        roles["encode+decode"] = (enc + vae, lay.aux_type)
    return {
        role: {"needs_gb": need, "usable_gb": gpu.usable_gb, "fits": need <= gpu.usable_gb}
        for role, (need, gpu) in roles.items()
    }

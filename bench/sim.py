"""Cluster simulator: capacity at SLO, colocated vs disaggregated at its best split, one scheduler.

Run ``uv run python bench/sim.py [--quick] [--json PATH] [--plots DIR]``. Virtual time, no
processes: ``mooncake_diffusion.simulate`` registers one worker per GPU (or per aux GPU
role) with the real ``Orchestrator`` under a ``VirtualClock`` and plays every dispatch for
the stage service times, memory sizes and GPU prices cited in ``docs/sources.md``. Both
layouts run the same ``OrchestratorConfig``; the summary's ``same_scheduler`` compares
the configurations every run used.

    parity       one request alone per kind: colocated vs disaggregated latency, against
                 the measured single-request times.
    lightx2v     LightX2V's 8 x RTX 4090 Qwen-Image setting (closed loop, 100 requests)
                 at every split the blog measured (8:0, 4:4, 5:3, 6:2, 7:1, and 4:0, 2:2,
                 3:1 on 4 GPUs), 8 and 50 steps; and both sides with no memory limit.
    capacity     the headline: per cell (workload x GPU type x cluster size), capacity at
                 SLO (``simulate.capacity_at_slo``: the highest Poisson rate at which
                 90 % / 99 % of requests finish within scale x their base latency, SLO
                 scale 1.0 / 1.25 / 1.5 and 3.0 for contrast), colocated against
                 disaggregated at its best split (aux GPUs swept, fractional E+V on
                 DiT GPUs included, chosen on separate seeds) and at the shipped sizing
                 rule's split; paired per-seed ratios with 95 % intervals; P50 / P99 TTFF
                 and end-to-end latency of both at a common rate.
    arrivals     two cells under bursty (two-state MMPP) and diurnal arrivals.
    cost         Encode + Decode on L40S instead of H100: capacity per GPU-hour price.
    ablation     mixed, 64 H100: each disaggregation mechanism off; sharing the decode
                 pool compared at the same aux GPU count.

``--quick`` runs every configuration with fewer seeds and is a smoke run: its summary
says ``smoke_run: true`` and ``verdicts_from_full: true`` (the verdicts are the full
run's, committed in ``docs/results/sim.json``). Every number is simulated time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    L40S,
    LOAD_GBPS,
    QWEN_1024,
    QWEN_4090,
    QWEN_4090_50,
    RTX_4090,
    WAN_720P,
    Bursty,
    Diurnal,
    GpuType,
    Layout,
    Mechanisms,
    Scheduler,
    Slo,
    Workload,
    capacity_at_slo,
    default_aux,
    simulate,
    slo_base,
)
from mooncake_diffusion.simulate.capacity import steady_horizon
from mooncake_diffusion.simulate.metrics import quantile

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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


CONFIGS: list[Any] = []  # every OrchestratorConfig a run used (same_scheduler)


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


def caps(w, lay, mech, base, slos, seeds, plan, arrivals=None, memory=None) -> list:
    out = []
    for s in seeds:
        c = capacity_at_slo(
            w,
            lay,
            mech,
            base=base,
            slos=slos,
            seed=s,
            arrivals=arrivals,
            arrivals_n=plan.arrivals_n,
            rel_tol=plan.rel_tol,
            memory=memory,
        )
        CONFIGS.extend(c.configs)
        plan.probes.append(len(c.probes))
        out.append(c)
    return out


def paired(a: list, b: list, key) -> tuple[float, float]:
    """Mean of per-seed ratios key(b) / key(a) and its CI half-width (zero bases skipped)."""
    xs = [key(y) / key(x) for x, y in zip(a, b, strict=True) if key(x) > 0]
    return mean_ci(xs)


def candidates(w: Workload, gpu: GpuType, n: int) -> list[Layout]:
    """Every split swept: E+V on 1..4 DiT GPUs (fractional), 1..n/2 aux GPUs."""
    auxes = sorted({1, 2, 3, 4, 6, 8, 12, 16, default_aux(w, n)} & set(range(1, n // 2 + 1)))
    hosts = (1, 2) if n <= 8 else (1, 2, 4)
    return [Layout("disaggregated", n, aux=0, hosts=h, gpu=gpu) for h in hosts] + [
        Layout("disaggregated", n, aux=a, gpu=gpu) for a in auxes
    ]


def latencies(w, lay, mech, rate, seed, plan, base) -> dict[str, float]:
    """P50 / P99 time to first frame (interactive requests; every request when the mix
    has none) and end-to-end latency (every request) at ``rate``."""
    warm_min = 2 * max(base[k.name] for k in kinds_of(w))
    horizon, warm = steady_horizon(rate, plan.arrivals_n, 0.25, warm_min)
    r = simulate(w, lay, mech, rate=rate, horizon=horizon, warmup=warm, seed=seed)
    CONFIGS.append(r.config)
    arrived = [x for x in r.records if warm <= x.submitted < horizon]
    inter = [x for x in arrived if x.kind.slo_class == "interactive"] or arrived
    ttff = [x.ttff - x.submitted for x in inter if x.ttff is not None]
    e2e = [x.done - x.submitted for x in arrived if x.done is not None]
    return {
        "p50_ttff_s": quantile(ttff, 0.5),
        "p99_ttff_s": quantile(ttff, 0.99),
        "p50_latency_s": quantile(e2e, 0.5),
        "p99_latency_s": quantile(e2e, 0.99),
    }


CELL_STATE: dict[str, dict[str, Any]] = {}


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


def side(c: list, slos) -> dict[str, Any]:
    out: dict[str, Any] = {"price_per_hour": c[0].price_per_hour}
    for slo in slos:
        m, h = mean_ci([x.per_gpu(slo) for x in c])
        out[f"per_gpu_{slo.label}"], out[f"per_gpu_{slo.label}_ci95"] = m, h
    out["cannot_fit"] = sorted({u for x in c for u in x.cannot_fit})
    return out


def capacity_cell(w: Workload, gpu: GpuType, n: int, plan: Plan) -> dict[str, Any]:
    name = cell_name(w, gpu, n)
    base = slo_base(kinds_of(w), gpu)
    colo = Layout("colocated", n, gpu=gpu)
    sel = {}
    for lay in candidates(w, gpu, n):
        got = caps(w, lay, None, base, (HEADLINE,), plan.select, plan)
        sel[lay.split] = (statistics.fmean(c.rate[HEADLINE] for c in got) / n, lay)
    best = max(sel.values(), key=lambda v: v[0])[1]
    rule = Layout("disaggregated", n, aux=default_aux(w, n), gpu=gpu)
    log(f"capacity: {name}: best split {best.split} (sizing rule {rule.split})")
    c = caps(w, colo, None, base, SLOS, plan.seeds, plan)
    b = caps(w, best, None, base, SLOS, plan.seeds, plan)
    rl = b if rule.split == best.split else caps(w, rule, None, base, (HEADLINE,), plan.seeds, plan)
    ratio = {s.label: paired(c, b, lambda x, s=s: x.per_gpu(s)) for s in SLOS}
    per_cost = paired(c, b, lambda x: x.per_usd_hour(HEADLINE))
    rule_ratio = paired(c, rl, lambda x: x.per_gpu(HEADLINE))
    lat_c, lat_b = [], []
    for i, s in enumerate(plan.seeds):
        rate = min(c[i].rate[HEADLINE], b[i].rate[HEADLINE])
        if rate > 0:
            lat_c.append(latencies(w, colo, None, rate, s, plan, base))
            lat_b.append(latencies(w, best, None, rate, s, plan, base))
    lat = {}
    for key in ("p50_ttff_s", "p99_ttff_s", "p50_latency_s", "p99_latency_s"):
        lat[key + "_colocated"] = statistics.fmean(x[key] for x in lat_c) if lat_c else None
        lat[key + "_disaggregated"] = statistics.fmean(x[key] for x in lat_b) if lat_b else None
        lat[key.replace("_s", "_ratio")] = paired(lat_c, lat_b, lambda x, k=key: x[k])
    CELL_STATE[name] = {"w": w, "gpu": gpu, "n": n, "base": base, "colo": c, "best": best}
    el = elastic_block(w, gpu, n, base, best, c, b, plan, rule_res=(rule, rl))
    r, h = ratio[HEADLINE.label]
    return {
        "part": "capacity",
        "cell": name,
        "workload": w.name,
        "gpu": gpu.name,
        "gpus": n,
        "slo_base_s": base,
        "best_split": best.split,
        "sizing_rule_split": rule.split,
        "memory": {"colocated": memory_report(w, colo), "disaggregated": memory_report(w, best)},
        "selection": {k: v[0] for k, v in sel.items()},
        "colocated": side(c, SLOS),
        "disaggregated": side(b, SLOS),
        "capacity_ratio": {k: v[0] for k, v in ratio.items()},
        "capacity_ratio_ci95": {k: v[1] for k, v in ratio.items()},
        "capacity_ratio_per_cost": per_cost[0],
        "capacity_ratio_per_cost_ci95": per_cost[1],
        "sizing_rule_ratio": rule_ratio[0],
        "sizing_rule_ratio_ci95": rule_ratio[1],
        "latency_at_common_rate": lat,
        "verdict": verdict(r, h),
        "sizing_rule_verdict": verdict(*rule_ratio),
        "elastic": el,
    }


def swap_matters(w: Workload) -> bool:
    """Whether the memory rule can change a run: with one kind, every GPU keeps its
    stages' models of that kind resident from the start (or the kind's placement
    offloads, priced by its measured times), so ``swap`` and ``resident`` runs are
    the same run (``test_sim_elastic`` checks it)."""
    return len({k.name for k in kinds_of(w)}) > 1


def elastic_block(
    w, gpu, n, base, best, c_res, b_res, plan, arrivals=None, rule_res=None
) -> dict[str, Any]:
    """Under the memory rule (``memory="swap"``, the same for every layout): colocated,
    the best static split (chosen on the tuning seeds), ``flex`` (every GPU holds
    every stage) and ``elastic`` (that split, resized online by the planner), on the
    judging seeds; paired per-seed ratios against colocated and the static split.
    ``rule_res``: (the sizing rule's layout, its resident capacities): where that
    split has two or more aux GPUs, elastic also starts from it with Encode and
    Decode on separate GPUs (which the planners may move), against that static
    split under the memory rule."""
    swap = swap_matters(w)
    h = (HEADLINE,)
    colo = Layout("colocated", n, gpu=gpu)

    def run(lay, seeds=plan.seeds):
        return caps(w, lay, None, base, h, seeds, plan, arrivals, memory="swap")

    if swap and arrivals is None:  # the best static split under the memory rule
        sel = {}
        for lay in candidates(w, gpu, n):
            got = run(lay, plan.select)
            sel[lay.split] = (statistics.fmean(c.rate[HEADLINE] for c in got) / n, lay)
        best = max(sel.values(), key=lambda v: v[0])[1]
        log(f"elastic: {cell_name(w, gpu, n)}: best split under the memory rule {best.split}")

    cs = run(colo) if swap or arrivals is not None else c_res
    bs = run(best) if swap or arrivals is not None else b_res
    if arrivals is None:
        CELL_STATE[cell_name(w, gpu, n)]["best_swap"] = best
    fx = run(Layout("flex", n, gpu=gpu)) if arrivals is None else None
    el_lay = replace(best, mode="elastic", planner=plan.planner)
    el = run(el_lay)

    def per_gpu(cs_):
        return statistics.fmean(x.per_gpu(HEADLINE) for x in cs_)

    def ratio(a, b_):
        m, hw = paired(a, b_, lambda x: x.per_gpu(HEADLINE))
        return {"ratio": m, "ci95": hw, "verdict": verdict(m, hw)}

    out: dict[str, Any] = {
        "memory_rule": "swap",
        "planner": plan.planner,
        "start_split": best.split,
        "elastic_layout": el_lay.split,
        "colocated_per_gpu": per_gpu(cs),
        "static_per_gpu": per_gpu(bs),
        "elastic_per_gpu": per_gpu(el),
        "elastic_vs_colocated": ratio(cs, el),
        "elastic_vs_best_static": ratio(bs, el),
        "static_vs_colocated": ratio(cs, bs),
        "stage_changes_per_search": statistics.fmean(x.stage_changes for x in el),
        "loaded_gb_per_search": {
            "colocated": statistics.fmean(x.loaded_gb for x in cs),
            "static": statistics.fmean(x.loaded_gb for x in bs),
            "elastic": statistics.fmean(x.loaded_gb for x in el),
        },
        "same_as_resident": not swap and arrivals is None,
    }
    if rule_res is not None and rule_res[0].aux >= 2:
        rule, rl = rule_res
        rs = run(rule) if swap else rl
        er_lay = replace(rule, mode="elastic", planner=plan.planner, split_aux=True)
        er = run(er_lay)
        out["from_sizing_rule"] = {
            "static_split": rule.split,
            "elastic_layout": er_lay.split,
            "static_per_gpu": per_gpu(rs),
            "elastic_per_gpu": per_gpu(er),
            "elastic_vs_static": ratio(rs, er),
            "elastic_vs_colocated": ratio(cs, er),
            "elastic_vs_best_static": ratio(bs, er),
            "stage_changes_per_search": statistics.fmean(x.stage_changes for x in er),
        }
    if fx is not None:
        out["flex_per_gpu"] = per_gpu(fx)
        out["flex_vs_colocated"] = ratio(cs, fx)
        out["loaded_gb_per_search"]["flex"] = statistics.fmean(x.loaded_gb for x in fx)
    return out


def lightx2v(requests: int = 100) -> list[dict[str, Any]]:
    """Closed loop, 100 requests, concurrency = the DiT workers; nothing cached; every
    split the blog measured; and both sides with no memory limit (an RTX 4090 with
    unbounded memory: no offload anywhere)."""
    rows = []
    unbounded = replace(RTX_4090, name="rtx4090-unbounded", memory_gb=1e9)
    for kind in (QWEN_4090, QWEN_4090_50):
        w = Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)
        base: dict[int, float] = {}
        for setting, (dits, aux, measured) in LIGHTX2V_SPLITS.items():
            for gpu in (RTX_4090, unbounded):
                if gpu is unbounded and setting not in ("8:0", "7:1"):
                    continue
                total = dits + aux
                if aux == 0:
                    lay, mech = Layout("colocated", total, gpu=gpu), Mechanisms.none()
                else:
                    lay, mech = Layout("disaggregated", total, aux=aux, gpu=gpu), Mechanisms()
                r = simulate(w, lay, mech, closed_loop=(dits, requests))
                CONFIGS.append(r.config)
                lats = sorted(x.done - x.submitted for x in r.records)
                qps = len(r.records) / r.makespan
                key = total * 10 + (gpu is unbounded)
                if aux == 0:
                    base[key] = qps
                rows.append(
                    {
                        "part": "lightx2v",
                        "steps": kind.steps,
                        "setting": setting,
                        "memory": "unbounded" if gpu is unbounded else "24 GB",
                        "qps": qps,
                        "qps_ratio": qps / base[key],
                        "p50_latency_s": lats[len(lats) // 2],
                        "measured_qps": measured if gpu is RTX_4090 else None,
                        "measured_p50_s": LIGHTX2V_P50.get(setting) if gpu is RTX_4090 else None,
                    }
                )
    return rows


def parity() -> list[dict[str, Any]]:
    rows = []
    for kind in (WAN_720P, QWEN_1024, FLUX_1024):
        w = Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)
        lat = {}
        for lay in (Layout("colocated", 8), Layout("disaggregated", 8, aux=1)):
            r = simulate(w, lay, closed_loop=(1, 1))
            CONFIGS.append(r.config)
            lat[lay.mode] = r.records[0].done - r.records[0].submitted
        iso = kind.isolated_s
        rows.append(
            {
                "part": "parity",
                "kind": kind.name,
                "colocated_s": lat["colocated"],
                "disaggregated_s": lat["disaggregated"],
                "ratio": lat["disaggregated"] / lat["colocated"],
                "measured_e2e_s": MEASURED_E2E[kind.name],
                "share_encode": kind.encode_s / iso,
                "share_denoise": kind.denoise_s / iso,
                "share_decode": kind.decode_s / iso,
                "measured_shares": MEASURED_SHARES.get(kind.name),
            }
        )
    return rows


def headline_pair(st: dict, lay: Layout, mech, plan: Plan, arrivals=None, base_caps=None):
    """Headline capacities of ``lay`` on the cell's judging seeds, and the paired ratio
    against ``base_caps`` (default: the cell's colocated capacities)."""
    got = caps(st["w"], lay, mech, st["base"], (HEADLINE,), plan.seeds, plan, arrivals)
    ref = base_caps if base_caps is not None else st["colo"]
    return got, paired(ref, got, lambda x: x.per_gpu(HEADLINE))


def arrivals_part(plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for w_name, gpu_name, n in ARRIVAL_CELLS:
        st = CELL_STATE.get(f"{w_name}-{n}x{gpu_name}")
        if st is None:
            continue
        for proc in (Bursty(), Diurnal()):
            log(f"arrivals: {w_name} {n} {proc.name}")
            colo = Layout("colocated", n, gpu=st["gpu"])
            c, _ = headline_pair(st, colo, None, plan, proc)
            b, (r, h) = headline_pair(st, st["best"], None, plan, proc, base_caps=c)
            cv = proc.cv(1.0) if isinstance(proc, Bursty) else None
            el = None
            if isinstance(proc, Bursty):
                best = st.get("best_swap", st["best"])
                el = elastic_block(st["w"], st["gpu"], n, st["base"], best, c, b, plan, proc)
            rows.append(
                {
                    "part": "arrivals",
                    "cell": f"{w_name}-{n}x{gpu_name}",
                    "arrivals": proc.name,
                    "params": asdict(proc),
                    "gap_cv": cv,
                    "split": st["best"].split,
                    "colocated_per_gpu": statistics.fmean(x.per_gpu(HEADLINE) for x in c),
                    "disaggregated_per_gpu": statistics.fmean(x.per_gpu(HEADLINE) for x in b),
                    "capacity_ratio": r,
                    "capacity_ratio_ci95": h,
                    "verdict": verdict(r, h),
                    "elastic": el,
                }
            )
    return rows


def cost_part(plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for w_name, gpu_name, n in COST_CELLS:
        cell = f"{w_name}-{n}x{gpu_name}"
        st = CELL_STATE.get(cell)
        if st is None:
            continue
        a = st["best"].aux or default_aux(st["w"], n)
        for aux_gpu in (H100, L40S):
            for k in (a, 2 * a):
                lay = Layout("disaggregated", n, aux=k, gpu=st["gpu"], aux_gpu=aux_gpu)
                log(f"cost: {cell} {lay.split}")
                got, _ = headline_pair(st, lay, None, plan)
                r, h = paired(st["colo"], got, lambda x: x.per_usd_hour(HEADLINE))
                rows.append(
                    {
                        "part": "cost",
                        "cell": cell,
                        "layout": f"{cell}: {n - k} {st['gpu'].name} + {k} {aux_gpu.name}",
                        "price_per_hour": got[0].price_per_hour,
                        "colocated_price_per_hour": st["colo"][0].price_per_hour,
                        "capacity_per_cost_ratio": r,
                        "capacity_per_cost_ratio_ci95": h,
                        "verdict": verdict(r, h),
                    }
                )
    return rows


def ablation_part(plan: Plan) -> list[dict[str, Any]]:
    w_name, gpu_name, n = ABLATION_CELL
    cell = f"{w_name}-{n}x{gpu_name}"
    st = CELL_STATE.get(cell)
    if st is None:
        return []
    rows = []
    a = st["best"].aux or default_aux(st["w"], n)
    on_lay = Layout("disaggregated", n, aux=a, gpu=st["gpu"])
    log(f"ablation: {cell} at {on_lay.split}")
    on, _ = headline_pair(st, on_lay, Mechanisms(), plan)
    for m in MECHS:
        _, (r, h) = headline_pair(st, on_lay, Mechanisms().without(m), plan, base_caps=on)
        rows.append(
            {
                "part": "ablation",
                "cell": cell,
                "split": on_lay.split,
                "switch": m,
                "capacity_change": r - 1,
                "capacity_change_ci95": h,
            }
        )
    # sharing at the same GPU count: one aux GPU per node, shared or per node
    nodes = max(1, n // on_lay.node_gpus)
    same = Layout("disaggregated", n, aux=nodes, gpu=st["gpu"])
    sh_on, _ = headline_pair(st, same, Mechanisms(), plan)
    _, (r, h) = headline_pair(
        st, same, Mechanisms().without("shared_decode"), plan, base_caps=sh_on
    )
    rows.append(
        {
            "part": "ablation",
            "cell": cell,
            "split": same.split,
            "switch": "shared_decode",
            "capacity_change": r - 1,
            "capacity_change_ci95": h,
        }
    )
    colo = Layout("colocated", n, gpu=st["gpu"])
    _, (r, h) = headline_pair(st, colo, Mechanisms(cross_instance_cache=True), plan)
    rows.append(
        {
            "part": "ablation",
            "cell": cell,
            "split": colo.split,
            "switch": "colocated+cross_instance_cache",
            "capacity_change": r - 1,
            "capacity_change_ci95": h,
        }
    )
    return rows


# --------------------------------------------------------------------------- output
def f(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def pm(x: float, h: float, spec: str = ".2f") -> str:
    return f"{f(x, spec)} ± {f(h, spec)}"


def verdict_lines(rows: list[dict]) -> list[str]:
    """One generated sentence per verdict: where disaggregation loses, ties, wins."""
    cap = [r for r in rows if r["part"] == "capacity"]
    out = []
    for v in ("lose", "tie", "win"):
        cells = [
            f"{r['cell']} ({r['capacity_ratio'][HEADLINE.label]:.2f}x at {r['best_split']})"
            for r in cap
            if r["verdict"] == v
        ]
        out.append(f"- **{v}** ({len(cells)}): {', '.join(cells) or 'none'}")
    return out


def markdown(rows: list[dict], sched: Scheduler, plan: Plan, smoke: bool) -> str:
    h = HEADLINE.label
    out = [
        f"Scheduler (both layouts): {asdict(sched)}; changed from the shipped core: "
        f"{sched.changed() or 'nothing'}. "
        + ("**Smoke run** (fewer seeds): verdicts are the full run's, not these. " if smoke else "")
        + f"{len(plan.seeds)} judging seeds, {len(plan.select)} split-choosing seeds, "
        f"{plan.arrivals_n} arrivals per probe after the warm-up.",
        "",
        f"### Capacity at SLO ({h}: the highest rate at which 90 % of requests finish "
        "within 1.5 x their base latency), disaggregated at its best split / colocated",
        "",
        *verdict_lines(rows),
        "",
        "| cell | best split | C req/s/GPU | D req/s/GPU | D/C per GPU | per cost | verdict "
        "| D/C at 1.0x | 1.25x | 1.5x@99% | 3x | sizing rule | rule D/C "
        "| P99 TTFF C / D s | P99 E2E C / D s |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "capacity"):
        c, d, cr, lat = (
            r["colocated"],
            r["disaggregated"],
            r["capacity_ratio"],
            r["latency_at_common_rate"],
        )
        ci = r["capacity_ratio_ci95"]
        out.append(
            f"| {r['cell']} | {r['best_split']} | {f(c['per_gpu_' + h], '.4g')} "
            f"| {f(d['per_gpu_' + h], '.4g')} | {pm(cr[h], ci[h])} "
            f"| {pm(r['capacity_ratio_per_cost'], r['capacity_ratio_per_cost_ci95'])} "
            f"| {r['verdict']} | {f(cr['1x@90%'], '.2f')} | {f(cr['1.25x@90%'], '.2f')} "
            f"| {f(cr['1.5x@99%'], '.2f')} | {f(cr['3x@90%'], '.2f')} "
            f"| {r['sizing_rule_split']} "
            f"| {pm(r['sizing_rule_ratio'], r['sizing_rule_ratio_ci95'])} "
            f"| {f(lat['p99_ttff_s_colocated'], '.1f')} / "
            f"{f(lat['p99_ttff_s_disaggregated'], '.1f')} "
            f"| {f(lat['p99_latency_s_colocated'], '.1f')} / "
            f"{f(lat['p99_latency_s_disaggregated'], '.1f')} |"
        )
    out += elastic_markdown(rows, plan)
    out += [
        "",
        "### Memory: what each GPU must hold for the whole mix (every model resident; "
        "switching models is not modelled)",
        "",
        "| cell | side | GPU role | needs GB | usable GB | fits untiled | cannot fit (no measured "
        "offload time) |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for r in (x for x in rows if x["part"] == "capacity"):
        for sd in ("colocated", "disaggregated"):
            for role, m in r["memory"][sd].items():
                out.append(
                    f"| {r['cell']} | {sd} | {role} | {m['needs_gb']:.1f} | {m['usable_gb']:.1f} "
                    f"| {'yes' if m['fits'] else '**no**'} "
                    f"| {', '.join(r[sd]['cannot_fit']) or '-'} |"
                )
    out += [
        "",
        "### Single-request parity and calibration (one request alone, H100)",
        "",
        "| kind | colocated s | disaggregated s | D/C | measured E2E s | shares E/D/V "
        "| measured shares |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in (x for x in rows if x["part"] == "parity"):
        ms = r["measured_shares"]
        out.append(
            f"| {r['kind']} | {r['colocated_s']:.2f} | {r['disaggregated_s']:.2f} "
            f"| {r['ratio']:.3f} | {'-'.join(f'{v:g}' for v in r['measured_e2e_s'])} "
            f"| {r['share_encode']:.1%} / {r['share_denoise']:.1%} / {r['share_decode']:.1%} "
            f"| {' / '.join(f'{v:.1%}' for v in ms) if ms else '-'} |"
        )
    out += [
        "",
        "### LightX2V's RTX 4090 Qwen-Image setting: every measured split (closed loop, "
        "100 requests)",
        "",
        "| steps | setting | memory | QPS | QPS / colocated | P50 s | measured QPS "
        "| measured P50 s |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "lightx2v"):
        out.append(
            f"| {r['steps']} | {r['setting']} | {r['memory']} | {r['qps']:.3f} "
            f"| {r['qps_ratio']:.2f} | {r['p50_latency_s']:.1f} | {f(r['measured_qps'])} "
            f"| {f(r['measured_p50_s'])} |"
        )
    out += [
        "",
        f"### Arrival shape ({h}, best Poisson split)",
        "",
        "| cell | arrivals | gap CV | split | C req/s/GPU | D req/s/GPU | D/C | verdict |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in (x for x in rows if x["part"] == "arrivals"):
        out.append(
            f"| {r['cell']} | {r['arrivals']} | {f(r['gap_cv'], '.2f')} | {r['split']} "
            f"| {r['colocated_per_gpu']:.4g} | {r['disaggregated_per_gpu']:.4g} "
            f"| {pm(r['capacity_ratio'], r['capacity_ratio_ci95'])} | {r['verdict']} |"
        )
    out += [
        "",
        f"### Heterogeneous pools: capacity per GPU-hour price ({h}) against colocated",
        "",
        "| layout | price $/h | colocated $/h | D/C per cost | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for r in (x for x in rows if x["part"] == "cost"):
        out.append(
            f"| {r['layout']} | {r['price_per_hour']:.1f} | {r['colocated_price_per_hour']:.1f} "
            f"| {pm(r['capacity_per_cost_ratio'], r['capacity_per_cost_ratio_ci95'])} "
            f"| {r['verdict']} |"
        )
    out += [
        "",
        f"### Ablation: capacity change with each mechanism off ({h})",
        "",
        "| cell | split | switch off | capacity change |",
        "|---|---|---|---:|",
    ]
    for r in (x for x in rows if x["part"] == "ablation"):
        out.append(
            f"| {r['cell']} | {r['split']} | {r['switch']} "
            f"| {pm(r['capacity_change'], r['capacity_change_ci95'], '+.1%')} |"
        )
    return "\n".join(out)


def elastic_lines(rows: list[dict]) -> list[str]:
    """Generated sentences: flex and elastic verdicts against colocated."""
    cap = [r for r in rows if r["part"] == "capacity" and r.get("elastic")]
    out = []
    for key, name in (("flex_vs_colocated", "flex"), ("elastic_vs_colocated", "elastic")):
        for v in ("lose", "tie", "win"):
            cells = [
                f"{r['cell']} ({r['elastic'][key]['ratio']:.2f}x)"
                for r in cap
                if key in r["elastic"] and r["elastic"][key]["verdict"] == v
            ]
            out.append(f"- {name} **{v}** ({len(cells)}): {', '.join(cells) or 'none'}")
    return out


def elastic_markdown(rows: list[dict], plan: Plan) -> list[str]:
    h = HEADLINE.label
    out = [
        "",
        f"### Flex and elastic pools ({h}), every layout under the memory rule "
        f"(models swap at {LOAD_GBPS:g} GB/s), planner `{plan.planner}`",
        "",
        *elastic_lines(rows),
        "",
        "| cell | arrivals | C req/s/GPU | static split | S/C | flex/C | verdict "
        "| elastic/C | verdict | elastic/S | verdict | moves per search |",
        "|---|---|---:|---|---:|---:|---|---:|---|---:|---|---:|",
    ]
    for r in rows:
        e = r.get("elastic") if r["part"] in ("capacity", "arrivals") else None
        if not e:
            continue
        fx = e.get("flex_vs_colocated")
        ev, es = e["elastic_vs_colocated"], e["elastic_vs_best_static"]
        sc = e["static_vs_colocated"]
        out.append(
            f"| {r['cell']} | {r.get('arrivals', 'poisson')} | {e['colocated_per_gpu']:.4g} "
            f"| {e['start_split']} | {pm(sc['ratio'], sc['ci95'])} "
            f"| {pm(fx['ratio'], fx['ci95']) if fx else '-'} | {fx['verdict'] if fx else '-'} "
            f"| {pm(ev['ratio'], ev['ci95'])} | {ev['verdict']} "
            f"| {pm(es['ratio'], es['ci95'])} | {es['verdict']} "
            f"| {e['stage_changes_per_search']:.1f} |"
        )
    out += [
        "",
        "Elastic started from the shipped sizing rule's split, Encode and Decode on "
        "separate GPUs (single-stage workers the planner may move), where that split "
        "has two or more aux GPUs:",
        "",
        "| cell | sizing rule | rule/C | elastic from it / rule | verdict | elastic/C "
        "| elastic/best static | moves per search |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        e = r.get("elastic") if r["part"] == "capacity" else None
        if not e or "from_sizing_rule" not in e:
            continue
        fr = e["from_sizing_rule"]
        vs, vc = fr["elastic_vs_static"], fr["elastic_vs_colocated"]
        vb = fr["elastic_vs_best_static"]
        out.append(
            f"| {r['cell']} | {fr['static_split']} "
            f"| {fr['static_per_gpu'] / e['colocated_per_gpu']:.2f} "
            f"| {pm(vs['ratio'], vs['ci95'])} | {vs['verdict']} "
            f"| {pm(vc['ratio'], vc['ci95'])} | {pm(vb['ratio'], vb['ci95'])} "
            f"| {fr['stage_changes_per_search']:.1f} |"
        )
    return out


def full_verdicts(path: str) -> dict[str, Any] | None:
    """The verdicts of the committed full run, if ``path`` holds one."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    s = doc.get("summary", {})
    if s.get("smoke_run", True):
        return None
    return {
        "verdicts": s.get("verdicts"),
        "verdict": s.get("verdict"),
        "flex_verdicts": s.get("flex_verdicts"),
        "elastic_verdicts": s.get("elastic_verdicts"),
    }


def summarize_rows(rows: list[dict], sched: Scheduler, plan: Plan, smoke: bool) -> dict:
    h = HEADLINE.label
    cap = {r["cell"]: r for r in rows if r["part"] == "capacity"}
    lx = {(r["steps"], r["setting"], r["memory"]): r for r in rows if r["part"] == "lightx2v"}
    par = [r for r in rows if r["part"] == "parity"]
    cst = [r for r in rows if r["part"] == "cost"]
    best_cost = max(cst, key=lambda r: r["capacity_per_cost_ratio"]) if cst else None
    own = {v: sum(r["verdict"] == v for r in cap.values()) for v in ("win", "tie", "lose")}
    lx_cell = cell_name(QWEN4090, RTX_4090, 8)
    calib = {
        name: {
            "simulated_qps": lx[(8, name, "24 GB")]["qps"],
            "measured_qps": meas,
            "relative_error": lx[(8, name, "24 GB")]["qps"] / meas - 1,
        }
        for name, (_, _, meas) in LIGHTX2V_SPLITS.items()
    }
    probes = statistics.fmean(plan.probes) if plan.probes else 0.0
    summary: dict[str, Any] = {
        "same_scheduler": len({repr(c) for c in CONFIGS}) == 1,
        "scheduler": {**asdict(sched), "changed_from_shipped": sched.changed()},
        "smoke_run": smoke,
        "verdicts_from_full": smoke,
        "seeds": {
            "judging": len(plan.seeds),
            "choosing_split": len(plan.select),
            "arrivals_per_probe": plan.arrivals_n,
            "probes_per_search_mean": probes,
            "arrivals_per_verdict": round(2 * len(plan.seeds) * probes * plan.arrivals_n),
        },
        "steady_state": (
            "warm-up excluded: each probe measures arrivals_per_probe arrivals after a "
            "warm-up of max(25 % of that window, 2 x the longest base latency); every "
            "request runs to completion; no admission control"
        ),
        "slo_attainment_target": HEADLINE.target,
        "slo_scale": HEADLINE.scale,
        "slo_scales_swept": sorted({s.scale for s in SLOS}),
        "slo_base": "per kind, the slower of its colocated and disaggregated latency alone",
        "search": f"bisection to {plan.rel_tol:.0%} of the upper bound, then interpolation",
        "capacity_ratio": {
            k: {
                "per_gpu": r["capacity_ratio"][h],
                "per_gpu_ci95": r["capacity_ratio_ci95"][h],
                "per_cost": r["capacity_ratio_per_cost"],
                "per_cost_ci95": r["capacity_ratio_per_cost_ci95"],
                "by_slo": r["capacity_ratio"],
            }
            for k, r in cap.items()
        },
        "best_split": {k: r["best_split"] for k, r in cap.items()},
        "sizing_rule_split": {k: r["sizing_rule_split"] for k, r in cap.items()},
        "sizing_rule_capacity_ratio": {k: r["sizing_rule_ratio"] for k, r in cap.items()},
        "verdict": {k: r["verdict"] for k, r in cap.items()},
        "verdicts": own,
        "p99_ttff_ratio": {
            k: r["latency_at_common_rate"]["p99_ttff_ratio"][0] for k, r in cap.items()
        },
        "p99_latency_ratio": {
            k: r["latency_at_common_rate"]["p99_latency_ratio"][0] for k, r in cap.items()
        },
        "lightx2v_setting_capacity_ratio": (
            cap[lx_cell]["capacity_ratio"][h] if lx_cell in cap else float("nan")
        ),
        "lightx2v_setting_qps_ratio": lx[(8, "7:1", "24 GB")]["qps_ratio"],
        "lightx2v_setting_qps_ratio_50_steps": lx[(50, "7:1", "24 GB")]["qps_ratio"],
        "no_memory_limit_ratio": lx[(8, "7:1", "unbounded")]["qps_ratio"],
        "no_memory_limit_ratio_50_steps": lx[(50, "7:1", "unbounded")]["qps_ratio"],
        "lightx2v_calibration_8_steps": calib,
        "single_request_latency_ratio": max(r["ratio"] for r in par),
        "capacity_per_cost_ratio_best": best_cost["capacity_per_cost_ratio"] if best_cost else None,
        "capacity_per_cost_best_layout": best_cost["layout"] if best_cost else None,
        "mechanisms": {r["switch"]: r["capacity_change"] for r in rows if r["part"] == "ablation"},
        "memory_all_models_fit": {
            k: {sd: all(m["fits"] for m in r["memory"][sd].values()) for sd in r["memory"]}
            for k, r in cap.items()
        },
        "arrivals": {
            f"{r['cell']} {r['arrivals']}": r["capacity_ratio"]
            for r in rows
            if r["part"] == "arrivals"
        },
    }
    summary["verdict_sentence"] = ("Smoke run, not verdicts: " if smoke else "") + (
        f"Verdicts over {len(cap)} cells at {HEADLINE.scale:g}x / {HEADLINE.target:.0%} "
        f"({len(plan.seeds)} seeds): {own['win']} win, {own['tie']} tie, {own['lose']} lose."
    )
    summary["verdict_lines"] = verdict_lines(rows)
    summary.update(elastic_summary(rows, plan))
    fv, ev = summary["flex_verdicts"], summary["elastic_verdicts"]
    summary["elastic_sentence"] = ("Smoke run, not verdicts: " if smoke else "") + (
        f"Under the memory rule, against colocated over {sum(ev.values())} cells at "
        f"{HEADLINE.scale:g}x / {HEADLINE.target:.0%} ({len(plan.seeds)} seeds): flex "
        f"{fv['win']} win, {fv['tie']} tie, {fv['lose']} lose; elastic ({plan.planner}) "
        f"{ev['win']} win, {ev['tie']} tie, {ev['lose']} lose."
    )
    summary["elastic_lines"] = elastic_lines(rows)
    if smoke:
        summary["smoke_verdicts"] = own
        summary["smoke_flex_verdicts"] = summary["flex_verdicts"]
        summary["smoke_elastic_verdicts"] = summary["elastic_verdicts"]
        full = full_verdicts(
            os.path.join(os.path.dirname(__file__), "..", "docs", "results", "sim.json")
        )
        if full is not None:
            summary["verdicts"], summary["verdict"] = full["verdicts"], full["verdict"]
            for key in ("flex_verdicts", "elastic_verdicts"):
                if full.get(key) is not None:
                    summary[key] = full[key]
    return summary


MEMORY_RULE = (
    "swap: a GPU holds the models of the stages it serves while they fit in 90 % of its "
    "memory less the decode peak it keeps free; an item whose model is not resident "
    "first loads it at load_gbps (evicting the least recently used), the GPU serving "
    "nothing meanwhile; the same rule for colocated, static, flex and elastic; a stage "
    "change loads the new stages' models the same way"
)


def elastic_summary(rows: list[dict], plan: Plan) -> dict[str, Any]:
    """The flex / elastic keys: verdicts against colocated (same scheduler, same memory
    rule) over the capacity cells, and elastic against the best static split on every
    workload (the bursty arrival cells included)."""
    cap = {r["cell"]: r["elastic"] for r in rows if r["part"] == "capacity" and r.get("elastic")}
    arr = {
        f"{r['cell']} {r['arrivals']}": r["elastic"]
        for r in rows
        if r["part"] == "arrivals" and r.get("elastic")
    }

    def counts(key: str) -> dict[str, int]:
        return {
            v: sum(e[key]["verdict"] == v for e in cap.values() if key in e)
            for v in ("win", "tie", "lose")
        }

    def vs_static(e: dict) -> dict:
        return {**e["elastic_vs_best_static"], "static_split": e["start_split"]}

    return {
        "memory_rule": MEMORY_RULE,
        "load_gbps": LOAD_GBPS,
        "planner": plan.planner,
        "flex_verdicts": counts("flex_vs_colocated"),
        "elastic_verdicts": counts("elastic_vs_colocated"),
        "flex_ratio": {k: e["flex_vs_colocated"] for k, e in cap.items()},
        "elastic_ratio": {k: e["elastic_vs_colocated"] for k, e in cap.items()},
        "elastic_vs_colocated_bursty": {k: e["elastic_vs_colocated"] for k, e in arr.items()},
        "elastic_vs_best_static": {
            **{k: vs_static(e) for k, e in cap.items()},
            **{k: vs_static(e) for k, e in arr.items()},
        },
        "static_vs_colocated_under_memory_rule": {
            k: e["static_vs_colocated"] for k, e in {**cap, **arr}.items()
        },
        "stage_changes_per_search": {
            k: e["stage_changes_per_search"] for k, e in {**cap, **arr}.items()
        },
        "elastic_from_sizing_rule": {
            k: {
                "static_split": e["from_sizing_rule"]["static_split"],
                "vs_static": e["from_sizing_rule"]["elastic_vs_static"],
                "vs_colocated": e["from_sizing_rule"]["elastic_vs_colocated"],
                "vs_best_static": e["from_sizing_rule"]["elastic_vs_best_static"],
                "stage_changes_per_search": e["from_sizing_rule"]["stage_changes_per_search"],
            }
            for k, e in cap.items()
            if "from_sizing_rule" in e
        },
    }


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mooncake_diffusion": importlib.metadata.version("mooncake-diffusion"),
        "note": "virtual time: results do not depend on this machine",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        epilog="Every configuration is the same with and without --quick; only seeds differ.",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, 1 to choose")
    p.add_argument("--seeds", type=int, help="judging seeds (default 8; --quick 2)")
    p.add_argument("--arrivals", type=int, default=ARRIVALS_N, help="arrivals per probe")
    p.add_argument("--cells", nargs="*", help="only these cells (e.g. image-8xh100)")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument(
        "--planner", default="reactive", help="the elastic layout's planner (registry name)"
    )
    a = p.parse_args(argv)
    if a.seeds is not None and a.seeds < 1:
        p.error("--seeds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    n = a.seeds if a.seeds is not None else (2 if a.quick else 8)
    smoke = n < 8 or a.arrivals < ARRIVALS_N or bool(a.cells)
    plan = Plan(n, 1 if smoke else len(SELECT_SEEDS), a.arrivals, REL_TOL, a.planner)
    sched = Scheduler()
    CONFIGS.clear()
    CELL_STATE.clear()
    rows = parity() + lightx2v()
    timing = {}
    for w, gpu, g in CELLS:
        name = cell_name(w, gpu, g)
        if a.cells and name not in a.cells:
            continue
        t = time.perf_counter()
        rows.append(capacity_cell(w, gpu, g, plan))
        timing[name] = time.perf_counter() - t
        log(f"  {name}: {timing[name]:.0f} s wall")
    rows += arrivals_part(plan) + cost_part(plan) + ablation_part(plan)
    summary = summarize_rows(rows, sched, plan, smoke)
    md = markdown(rows, sched, plan, smoke)
    print(md)
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.1f} s wall; every other number is simulated time")
    if a.json:
        doc = {
            "bench": "sim",
            "machine": machine_info(),
            "config": {
                "quick": a.quick,
                "seeds": n,
                "select_seeds": plan.select,
                "arrivals_per_probe": plan.arrivals_n,
                "rel_tol": plan.rel_tol,
                "slos": [asdict(s) for s in SLOS],
                "cells": [cell_name(w, g, k) for w, g, k in CELLS],
                "scheduler": asdict(sched),
                "planner": plan.planner,
                "memory_rule": MEMORY_RULE,
                "load_gbps": LOAD_GBPS,
                "kinds": {
                    k.name: asdict(k)
                    for k in (WAN_720P, QWEN_1024, FLUX_1024, QWEN_4090, QWEN_4090_50)
                },
                "gpus": {g.name: asdict(g) for g in (H100, L40S, RTX_4090)},
                "wall_seconds_per_cell": timing,
            },
            "rows": rows,
            "summary": summary,
            "markdown": md,
            "total_seconds": total,
        }
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

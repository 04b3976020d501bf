"""bench/sim.py's searches: every simulator run the bench makes, one function per part,
each returning that part's JSON rows.

    parity()           one request alone per kind, both layouts
    lightx2v()         LightX2V's closed-loop setting at every split the blog measured
    capacity_cell()    capacity at SLO of one cell: the best split chosen on separate
                       seeds, colocated against it, latencies at a common rate, and
                       elastic_block() (flex and elastic under the memory rule)
    arrivals_part(), cost_part(), ablation_part()   reuse what capacity_cell() left
                       in ``CELL_STATE``, so they run after it (a cell not run: no rows)

``CONFIGS`` collects every ``OrchestratorConfig`` a run used (the summary's
``same_scheduler``); ``sim.main`` clears it and ``CELL_STATE`` before a run.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, replace
from typing import Any

from sim_model import (
    ABLATION_CELL,
    ARRIVAL_CELLS,
    COST_CELLS,
    HEADLINE,
    LIGHTX2V_P50,
    LIGHTX2V_SPLITS,
    MEASURED_E2E,
    MEASURED_SHARES,
    MECHS,
    SLOS,
    Plan,
    cell_name,
    kinds_of,
    mean_ci,
    memory_report,
    paired,
    verdict,
)

from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    L40S,
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
    Workload,
    capacity_at_slo,
    default_aux,
    simulate,
    slo_base,
)
from mooncake_diffusion.simulate.capacity import steady_horizon
from mooncake_diffusion.simulate.metrics import quantile


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


CONFIGS: list[Any] = []  # every OrchestratorConfig a run used (same_scheduler)

CELL_STATE: dict[str, dict[str, Any]] = {}  # per capacity cell: what the later parts reuse


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

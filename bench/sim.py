"""Cluster simulator: colocated vs disaggregated serving under one scheduler, in virtual time.

Run ``uv run python bench/sim.py [--quick] [--json PATH] [--plots DIR] [--seeds N]``.
Virtual time, no processes: ``mooncake_diffusion.simulate`` registers one worker per
GPU (or per aux GPU role) with the real ``Orchestrator`` under a ``VirtualClock`` and
plays every dispatch for the stage service times, memory sizes and GPU prices cited in
workloads.md (``simulate/costs.py``). Both layouts run the same ``OrchestratorConfig``
(priorities, step-boundary preemption, the shipped ``max_preemptions``); the summary's
``same_scheduler`` is computed by comparing the configurations every run used.

    parity       one request alone per kind: colocated vs disaggregated latency.
    calibration  single-request latency and stage shares against the cited
                 measurements; LightX2V's 8 x RTX 4090 setting (100 requests, closed
                 loop) at 8 and 50 denoise steps (its blog does not state the step
                 count), 8:0 colocated vs 7:1, against its measured 0.18 / 0.34 QPS.
    matrix       workloads (image, video, mixed, shifting: the mixed mix turning
                 video-heavy halfway) x 8 / 64 GPUs x loads 50 / 80 / 95 % of the
                 isolated capacity; goodput (completions within the SLO per second)
                 with a 95 % confidence interval over seeds, and a verdict: win / tie
                 / lose for disaggregation.
    cost         the mixed workload, 64 GPUs, 95 % load, heterogeneous pools: Encode +
                 Decode on H100 or L40S, aux pool of the default size or twice it;
                 goodput per GPU-hour price vs colocated.
    ablation     the mixed workload, 64 GPUs, 95 % load: each mechanism off for the
                 disaggregated side, and the cross-instance cache on for colocated.

``--quick`` runs the same settings with fewer seeds (3 instead of 8). Every number is
simulated time from cited costs; the wall time of the run says nothing.
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
from dataclasses import asdict
from typing import Any

from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    L40S,
    QWEN_1024,
    QWEN_4090,
    QWEN_4090_50,
    RTX_4090,
    WAN_720P,
    Layout,
    Mechanisms,
    Scheduler,
    Workload,
    default_aux,
    simulate,
    summarize,
)

IMAGE = Workload("image", ((QWEN_1024, 0.5), (FLUX_1024, 0.5)))
VIDEO = Workload("video", ((WAN_720P, 1.0),))
MIXED = Workload("mixed", ((QWEN_1024, 0.45), (FLUX_1024, 0.45), (WAN_720P, 0.10)))
SHIFTING = Workload(
    "shifting", MIXED.kinds, later=((QWEN_1024, 0.35), (FLUX_1024, 0.35), (WAN_720P, 0.30))
)
WORKLOADS = (IMAGE, VIDEO, MIXED, SHIFTING)
SCALES = (8, 64)
LOADS = (0.5, 0.8, 0.95)
TARGET_REQUESTS = 1000
HEADLINE = ("mixed", 8, 0.8)  # goodput / TTFF ratios at equal GPU count
ABLATION_AT = (64, 0.95)  # near saturation, where a saved second shows in goodput
MECHS = ("fit_memory", "decode_off_dit", "shared_decode", "cross_instance_cache")
# workloads.md §7.1 (M): LightX2V blog, 8 x RTX 4090, 100 requests
LIGHTX2V_MEASURED = {"8:0": {"qps": 0.18, "p50_s": 22.0}, "7:1": {"qps": 0.34, "p50_s": 17.0}}
# workloads.md §2.2 / §0.1 (M): single-request end-to-end seconds on one H100, and the
# measured stage shares (encode, denoise, decode) where a source gives them
MEASURED_E2E = {"qwen-1024": (12.77, 13.10), "flux-1024": (4.30, 6.71), "wan-720p": (1041.5,)}
MEASURED_SHARES = {"qwen-1024": (0.010, 0.962, 0.012)}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def horizon_for(w: Workload, gpus: int, load: float) -> float:
    """Enough virtual time for TARGET_REQUESTS arrivals and 8 of the longest request."""
    rate = load * gpus / w.mean_gpu_seconds()
    kinds = w.kinds + (w.later or ())
    return max(TARGET_REQUESTS / rate, 8 * max(k.isolated_s for k, _ in kinds))


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (Student t)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


CONFIGS: list[Any] = []  # every OrchestratorConfig a run used (same_scheduler)


def one(w: Workload, lay: Layout, mech: Mechanisms, load: float, seed: int) -> dict[str, Any]:
    r = simulate(w, lay, mech, load=load, horizon=horizon_for(w, lay.gpus, load), seed=seed)
    CONFIGS.append(r.config)
    s = summarize(r)
    return {
        "goodput_rps": s.goodput,
        "goodput_per_gpu": s.goodput / lay.gpus,
        "goodput_per_usd_hour": s.goodput * 3600 / r.price_per_hour,
        "throughput_rps": s.throughput,
        "slo_met": s.slo_met,
        "p99_ttff_s": s.p99_ttff,
        "p99_batch_latency_s": s.p99_latency_batch,
        "preemptions": s.preemptions,
        "encodes_skipped": s.encodes_skipped,
        "utilisation": s.utilisation,
        "price_per_hour": r.price_per_hour,
    }


def over_seeds(
    w: Workload, lay: Layout, mech: Mechanisms, load: float, seeds: list[int]
) -> dict[str, Any]:
    """Per-seed runs folded into means, with a CI for goodput and P99 TTFF."""
    runs = [one(w, lay, mech, load, s) for s in seeds]
    out: dict[str, Any] = {"seeds": len(seeds), "per_seed": runs}
    for key in ("goodput_rps", "goodput_per_gpu", "goodput_per_usd_hour", "p99_ttff_s"):
        out[key], out[key + "_ci95"] = mean_ci([r[key] for r in runs])
    for key in ("throughput_rps", "slo_met", "p99_batch_latency_s", "price_per_hour"):
        out[key] = statistics.fmean(r[key] for r in runs)
    out["preemptions"] = sum(r["preemptions"] for r in runs)
    pools = runs[0]["utilisation"]
    out["utilisation"] = {k: statistics.fmean(r["utilisation"][k] for r in runs) for k in pools}
    return out


def paired_ratio(a: dict, b: dict, key: str) -> tuple[float, float]:
    """Mean of per-seed ratios b/a (same seed, same arrivals) and its CI half-width."""
    xs = [y[key] / x[key] for x, y in zip(a["per_seed"], b["per_seed"], strict=True) if x[key]]
    return mean_ci(xs) if xs else (float("nan"), float("nan"))


def verdict(ratio: float, half: float) -> str:
    """win / lose when the 95 % CI of the goodput ratio excludes 1 (and 2 %), else tie."""
    if math.isnan(ratio):
        return "n/a"
    half = 0.0 if math.isnan(half) else half
    if ratio - half > 1.02:
        return "win"
    if ratio + half < 0.98:
        return "lose"
    return "tie"


# --------------------------------------------------------------------------- parts
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


def lightx2v(requests: int = 100) -> list[dict[str, Any]]:
    """workloads.md §7.1: 100 requests, concurrency = the number of DiT workers (§9);
    nothing cached (LightX2V has no embedding cache), at 8 and 50 steps."""
    rows = []
    for kind in (QWEN_4090, QWEN_4090_50):
        w = Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)
        setups = [
            ("8:0", Layout("colocated", 8, gpu=RTX_4090), Mechanisms.none(), 8),
            ("7:1", Layout("disaggregated", 8, aux=1, gpu=RTX_4090), Mechanisms(), 7),
            (
                "7:1 without fit_memory",
                Layout("disaggregated", 8, aux=1, gpu=RTX_4090),
                Mechanisms().without("fit_memory"),
                7,
            ),
        ]
        base = None
        for name, lay, mech, conc in setups:
            r = simulate(w, lay, mech, closed_loop=(conc, requests))
            CONFIGS.append(r.config)
            lats = sorted(x.done - x.submitted for x in r.records)
            qps = len(r.records) / r.makespan
            base = base or qps
            meas = LIGHTX2V_MEASURED.get(name, {})
            rows.append(
                {
                    "part": "lightx2v",
                    "steps": kind.steps,
                    "setting": name,
                    "qps": qps,
                    "qps_ratio": qps / base,
                    "p50_latency_s": lats[len(lats) // 2],
                    "measured_qps": meas.get("qps"),
                    "measured_p50_s": meas.get("p50_s"),
                }
            )
    return rows


def matrix(seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for w in WORKLOADS:
        for g in SCALES:
            aux = default_aux(w, g)
            for load in LOADS:
                log(f"matrix: {w.name} {g} GPUs load {load:.2f} (aux {aux})")
                c = over_seeds(w, Layout("colocated", g), Mechanisms.none(), load, seeds)
                d = over_seeds(w, Layout("disaggregated", g, aux=aux), Mechanisms(), load, seeds)
                gr, gh = paired_ratio(c, d, "goodput_rps")
                tr, th = paired_ratio(c, d, "p99_ttff_s")
                rows.append(
                    {
                        "part": "matrix",
                        "workload": w.name,
                        "gpu": "h100",
                        "gpus": g,
                        "aux": aux,
                        "load": load,
                        "colocated": c,
                        "disaggregated": d,
                        "goodput_ratio": gr,
                        "goodput_ratio_ci95": gh,
                        "p99_ttff_ratio": tr,
                        "p99_ttff_ratio_ci95": th,
                        "verdict": verdict(gr, gh),
                    }
                )
    return rows


def cost(seeds: list[int]) -> list[dict[str, Any]]:
    g, load = ABLATION_AT
    w = MIXED
    aux = default_aux(w, g)
    c = over_seeds(w, Layout("colocated", g), Mechanisms.none(), load, seeds)
    rows = []
    for aux_gpu in (H100, L40S):
        for n in (aux, 2 * aux):
            lay = Layout("disaggregated", g, aux=n, aux_gpu=aux_gpu)
            log(f"cost: {g - n} H100 denoise : {n} {aux_gpu.name} aux")
            d = over_seeds(w, lay, Mechanisms(), load, seeds)
            r, h = paired_ratio(c, d, "goodput_per_usd_hour")
            rows.append(
                {
                    "part": "cost",
                    "workload": w.name,
                    "gpus": g,
                    "load": load,
                    "layout": f"{g - n} h100 : {n} {aux_gpu.name}",
                    "colocated": c,
                    "disaggregated": d,
                    "goodput_per_cost_ratio": r,
                    "goodput_per_cost_ratio_ci95": h,
                    "verdict": verdict(r, h),
                }
            )
    return rows


def ablation(seeds: list[int]) -> list[dict[str, Any]]:
    g, load = ABLATION_AT
    w = MIXED
    aux = default_aux(w, g)
    dis = Layout("disaggregated", g, aux=aux)
    log(f"ablation: mixed {g} GPUs load {load}")
    on = over_seeds(w, dis, Mechanisms(), load, seeds)
    colo = over_seeds(w, Layout("colocated", g), Mechanisms.none(), load, seeds)
    rows = [
        {"part": "ablation", "setting": "disaggregated, all on", "switch": None, **on},
        {"part": "ablation", "setting": "colocated", "switch": None, **colo},
    ]
    for m in MECHS:
        off = over_seeds(w, dis, Mechanisms().without(m), load, seeds)
        r, h = paired_ratio(on, off, "goodput_rps")
        t, _ = paired_ratio(on, off, "p99_ttff_s")
        rows.append(
            {
                "part": "ablation",
                "setting": f"disaggregated without {m}",
                "switch": m,
                **off,
                "goodput_change": r - 1,
                "goodput_change_ci95": h,
                "p99_ttff_change": t - 1,
            }
        )
    cc = over_seeds(w, Layout("colocated", g), Mechanisms(cross_instance_cache=True), load, seeds)
    r, h = paired_ratio(colo, cc, "goodput_rps")
    t, _ = paired_ratio(colo, cc, "p99_ttff_s")
    rows.append(
        {
            "part": "ablation",
            "setting": "colocated with cross_instance_cache",
            "switch": "colocated+cross_instance_cache",
            **cc,
            "goodput_change": r - 1,
            "goodput_change_ci95": h,
            "p99_ttff_change": t - 1,
        }
    )
    return rows


# --------------------------------------------------------------------------- output
def f(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def pm(x: float, h: float, spec: str = ".2f") -> str:
    return f"{f(x, spec)} ± {f(h, spec)}"


def markdown(rows: list[dict], sched: Scheduler) -> str:
    out = [
        f"Scheduler (both layouts): {asdict(sched)}; changed from the shipped core: "
        f"{sched.changed() or 'nothing'}",
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
        "### LightX2V's 8 x RTX 4090 Qwen-Image setting, step sweep (measured: 8:0 0.18 QPS, "
        "P50 22 s; 7:1 0.34 QPS, P50 17 s)",
        "",
        "| steps | setting | QPS | QPS ratio | P50 s | measured QPS | measured P50 s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "lightx2v"):
        out.append(
            f"| {r['steps']} | {r['setting']} | {r['qps']:.3f} | {r['qps_ratio']:.2f} "
            f"| {r['p50_latency_s']:.1f} | {f(r['measured_qps'])} | {f(r['measured_p50_s'])} |"
        )
    out += [
        "",
        "### Where disaggregation wins, ties and loses (H100, equal GPU count; ± 95 % CI "
        "over seeds)",
        "",
        "| workload | GPUs | aux | load | C goodput/s | D goodput/s | goodput D/C | verdict "
        "| C P99 TTFF s | D P99 TTFF s | TTFF D/C |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "matrix"):
        c, d = r["colocated"], r["disaggregated"]
        out.append(
            f"| {r['workload']} | {r['gpus']} | {r['aux']} | {r['load']:.0%} "
            f"| {f(c['goodput_rps'], '.4g')} | {f(d['goodput_rps'], '.4g')} "
            f"| {pm(r['goodput_ratio'], r['goodput_ratio_ci95'])} | {r['verdict']} "
            f"| {f(c['p99_ttff_s'], '.1f')} | {f(d['p99_ttff_s'], '.1f')} "
            f"| {pm(r['p99_ttff_ratio'], r['p99_ttff_ratio_ci95'])} |"
        )
    out += [
        "",
        "### Heterogeneous pools: goodput per GPU-hour price (mixed, "
        f"{ABLATION_AT[0]} GPUs, {ABLATION_AT[1]:.0%} load)",
        "",
        "| layout | price $/h | goodput/s | goodput per $/h (x3600) | vs colocated | verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    cst = [x for x in rows if x["part"] == "cost"]
    if cst:
        c = cst[0]["colocated"]
        out.append(
            f"| colocated 64 h100 | {c['price_per_hour']:.1f} | {c['goodput_rps']:.4g} "
            f"| {c['goodput_per_usd_hour']:.4g} | 1 | - |"
        )
    for r in cst:
        d = r["disaggregated"]
        out.append(
            f"| {r['layout']} | {d['price_per_hour']:.1f} | {d['goodput_rps']:.4g} "
            f"| {d['goodput_per_usd_hour']:.4g} "
            f"| {pm(r['goodput_per_cost_ratio'], r['goodput_per_cost_ratio_ci95'])} "
            f"| {r['verdict']} |"
        )
    out += [
        "",
        f"### Ablation: mixed, {ABLATION_AT[0]} GPUs, {ABLATION_AT[1]:.0%} load "
        "(each mechanism off for disaggregated)",
        "",
        "| setting | goodput/s | goodput change | SLO met | P99 TTFF s | P99 TTFF change "
        "| preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "ablation"):
        ch = pm(r["goodput_change"], r["goodput_change_ci95"], "+.1%") if r["switch"] else "-"
        out.append(
            f"| {r['setting']} | {r['goodput_rps']:.4g} | {ch} | {r['slo_met']:.1%} "
            f"| {r['p99_ttff_s']:.1f} | {f(r.get('p99_ttff_change'), '+.1%')} "
            f"| {r['preemptions']} |"
        )
    return "\n".join(out)


def summarize_rows(rows: list[dict], sched: Scheduler) -> dict[str, Any]:
    def mrow(w: str, g: int, load: float) -> dict:
        return next(
            r
            for r in rows
            if r["part"] == "matrix" and (r["workload"], r["gpus"], r["load"]) == (w, g, load)
        )

    head = mrow(*HEADLINE)
    lx = {(r["steps"], r["setting"]): r for r in rows if r["part"] == "lightx2v"}
    par = [r for r in rows if r["part"] == "parity"]
    ab = [r for r in rows if r["part"] == "ablation" and r["switch"]]
    cst = [r for r in rows if r["part"] == "cost"]
    best = max(cst, key=lambda r: r["goodput_per_cost_ratio"])
    verdicts = [r["verdict"] for r in rows if r["part"] == "matrix"]
    summary: dict[str, Any] = {
        "same_scheduler": len({repr(c) for c in CONFIGS}) == 1,
        "scheduler": {**asdict(sched), "changed_from_shipped": sched.changed()},
        "goodput_ratio_mixed": head["goodput_ratio"],
        "goodput_ratio_mixed_ci95": head["goodput_ratio_ci95"],
        "goodput_per_cost_ratio_best": best["goodput_per_cost_ratio"],
        "goodput_per_cost_best_layout": best["layout"],
        "p99_ttff_ratio_interactive_80pct": head["p99_ttff_ratio"],
        "single_request_latency_ratio": max(r["ratio"] for r in par),
        "lightx2v_setting_qps_ratio": lx[(8, "7:1")]["qps_ratio"],
        "lightx2v_setting_qps_ratio_50_steps": lx[(50, "7:1")]["qps_ratio"],
        "lightx2v_baseline_qps_8_steps": lx[(8, "8:0")]["qps"],
        "lightx2v_baseline_measured_qps": LIGHTX2V_MEASURED["8:0"]["qps"],
        "mechanisms": {r["switch"]: r["goodput_change"] for r in ab},
        "mechanisms_p99_ttff_change": {r["switch"]: r["p99_ttff_change"] for r in ab},
        "mechanisms_at": f"mixed, {ABLATION_AT[0]} H100, {ABLATION_AT[1]:.0%} load",
        "verdicts": {v: verdicts.count(v) for v in ("win", "tie", "lose")},
        "headline_at": f"{HEADLINE[0]}, {HEADLINE[1]} H100, {HEADLINE[2]:.0%} load",
    }
    for g in SCALES:
        for load in LOADS:
            summary[f"goodput_ratio_mixed_{g}gpu_{round(load * 100)}pct"] = mrow("mixed", g, load)[
                "goodput_ratio"
            ]
    return summary


def plots(rows: list[dict], folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    written = []
    m = [r for r in rows if r["part"] == "matrix"]
    fig, axes = plt.subplots(1, len(SCALES), figsize=(4.6 * len(SCALES), 3.6), squeeze=False)
    for ax, g in zip(axes[0], SCALES, strict=True):
        for w in WORKLOADS:
            pts = sorted(
                (r["load"], r["goodput_ratio"], r["goodput_ratio_ci95"])
                for r in m
                if r["gpus"] == g and r["workload"] == w.name
            )
            ax.errorbar(
                [p[0] * 100 for p in pts],
                [p[1] for p in pts],
                yerr=[0 if math.isnan(p[2]) else p[2] for p in pts],
                marker="o",
                capsize=3,
                label=w.name,
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{g} H100")
        ax.set_xlabel("load (% of isolated capacity)")
        ax.set_ylabel("goodput disaggregated / colocated")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(folder, "goodput_ratio_vs_load.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


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
        epilog="Every setting is the same with and without --quick; only the seeds differ.",
    )
    p.add_argument("--quick", action="store_true", help="3 seeds instead of 8")
    p.add_argument("--seeds", type=int, help="number of seeds (overrides --quick)")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into this folder")
    a = p.parse_args(argv)
    if a.seeds is not None and a.seeds < 1:
        p.error("--seeds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    n = a.seeds if a.seeds is not None else (3 if a.quick else 8)
    seeds = list(range(n))
    sched = Scheduler()
    CONFIGS.clear()
    rows = parity() + lightx2v() + matrix(seeds) + cost(seeds) + ablation(seeds)
    summary = summarize_rows(rows, sched)
    print(markdown(rows, sched))
    total = time.perf_counter() - t0
    print("\n| summary | value |\n|---|---:|")
    for k, v in summary.items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(f"\ntotal {total:.1f} s wall; every other number is simulated time")
    written = plots(rows, a.plots) if a.plots else []
    for p in written:
        log(f"wrote {p}")
    if a.json:
        doc = {
            "bench": "sim",
            "machine": machine_info(),
            "config": {
                "quick": a.quick,
                "seeds": n,
                "scales": list(SCALES),
                "loads": list(LOADS),
                "target_requests": TARGET_REQUESTS,
                "scheduler": asdict(sched),
                "slo": "interactive 3 x isolated latency, batch 2 x (simulate/costs.py)",
                "kinds": {
                    k.name: asdict(k)
                    for k in (WAN_720P, QWEN_1024, FLUX_1024, QWEN_4090, QWEN_4090_50)
                },
                "gpus": {g.name: asdict(g) for g in (H100, L40S, RTX_4090)},
            },
            "rows": rows,
            "summary": summary,
            "markdown": markdown(rows, sched),
            "plots": written,
            "total_seconds": total,
        }
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bench/sim.py's report: the JSON summary and the markdown tables made from the rows
that ``sim_search`` returns, and the machine block of the JSON.

    summarize_rows()   the summary: verdicts, ratios, calibration, the generated
                       sentences docs/evaluation.md and the README quote
    markdown()         the tables printed and stored as the JSON's ``markdown``
    machine_info()     the JSON's ``machine``

A smoke run's summary carries the verdicts of the committed full run
(docs/results/sim.json), see ``full_verdicts``.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

from sim_model import HEADLINE, LIGHTX2V_SPLITS, MEMORY_RULE, QWEN4090, SLOS, Plan, cell_name
from sim_search import CONFIGS

from mooncake_diffusion.simulate import LOAD_GBPS, RTX_4090, Scheduler


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

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
import json
import sys
import time
from dataclasses import asdict

from sim_model import ARRIVALS_N, CELLS, MEMORY_RULE, REL_TOL, SELECT_SEEDS, SLOS, Plan, cell_name
from sim_report import machine_info, markdown, summarize_rows
from sim_search import (
    CELL_STATE,
    CONFIGS,
    ablation_part,
    arrivals_part,
    capacity_cell,
    cost_part,
    lightx2v,
    log,
    parity,
)

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
    Scheduler,
)


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

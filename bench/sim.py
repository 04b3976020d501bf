"""Cluster simulator: colocated vs disaggregated serving on the real orchestrator core.

Run ``uv run python bench/sim.py [--quick] [--json PATH] [--plots DIR] [--seed N]``.
Virtual time, no processes: ``mooncake_diffusion.simulate`` registers one worker per
GPU (or per aux GPU role) with the real ``Orchestrator`` under a ``VirtualClock`` and
plays every dispatch for the stage service times of workloads.md (each number is cited
in ``simulate/costs.py``). Parts:

    parity     one request alone, colocated vs disaggregated: must be at parity
               (workloads.md §0.1, §7.1: denoise is 96-99 %; LightX2V and vLLM-Omni
               measure equal single-request latency). Disaggregated adds 2 x 25 ms.
    matrix     workloads (image: Qwen-Image + FLUX, video: Wan2.2-A14B 720p, mixed:
               45 % Qwen + 45 % FLUX interactive, 10 % Wan batch, by count) x 8 / 64 /
               512 GPUs x Poisson loads (a share of the isolated capacity), colocated
               (each GPU runs whole requests, FIFO) vs disaggregated (aux GPUs host
               encode + decode, sized by the stage-time ratio; the others denoise;
               priorities, step-boundary preemption, embedding cache). Goodput counts
               completions within the SLO (interactive 3 x isolated, batch 2 x) per
               second; TTFF is interactive requests' time to first frame.
    ablation   the mixed workload at 64 GPUs, 90 % load, and LightX2V's 4090 setting:
               every mechanism switched off one at a time.
    sharing    the decode-pool sharing ratio N denoise : M aux GPUs at 64 GPUs.
    lightx2v   8 x RTX 4090, Qwen-Image T2I, 100 requests closed loop (concurrency = DiT
               workers): 8 colocated vs 7 DiT : 1 encoder, against the claimed 1.89x.

Reading the output: every number is virtual (simulated) time from cited stage costs;
the wall time of the run says nothing. Gains come only from mechanisms the simulator
models explicitly (``simulate/cluster.py`` docstring lists them and what is not).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Any

from mooncake_diffusion.simulate import (
    FLUX_1024,
    QWEN_1024,
    QWEN_4090,
    WAN_720P,
    Layout,
    Mechanisms,
    Workload,
    default_aux,
    simulate,
    summarize,
)

IMAGE = Workload("image", ((QWEN_1024, 0.5), (FLUX_1024, 0.5)))
VIDEO = Workload("video", ((WAN_720P, 1.0),))
MIXED = Workload("mixed", ((QWEN_1024, 0.45), (FLUX_1024, 0.45), (WAN_720P, 0.10)))
WORKLOADS = (IMAGE, VIDEO, MIXED)
LIGHTX2V_CLAIM = 0.34 / 0.18  # workloads.md §7.1: 0.34 QPS vs 0.18 QPS baseline (M)
MECHS = ("priorities", "embedding_cache", "decode_off_dit", "no_offload", "shared_decode")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def horizon_for(w: Workload, gpus: int, load: float, target: int) -> float:
    """Enough virtual time for ``target`` arrivals and at least 8 of the longest request."""
    rate = load * gpus / w.mean_gpu_seconds()
    longest = max(k.isolated_s for k, _ in w.kinds)
    return max(target / rate, 8 * longest)


def run_row(
    part: str,
    w: Workload,
    lay: Layout,
    mech: Mechanisms,
    load: float,
    horizon: float,
    seed: int,
    **extra: Any,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = simulate(w, lay, mech, load=load, horizon=horizon, seed=seed)
    s = summarize(r)
    return {
        "part": part,
        "workload": w.name,
        "mode": lay.mode,
        "gpus": lay.gpus,
        "aux": lay.aux if lay.mode == "disaggregated" else 0,
        "load": load,
        "mechanisms": [m for m in MECHS if getattr(mech, m)] if lay.mode != "colocated" else [],
        **extra,
        "requests": s.requests,
        "throughput_rps": s.throughput,
        "goodput_rps": s.goodput,
        "slo_met": s.slo_met,
        "p50_ttff_s": s.p50_ttff,
        "p99_ttff_s": s.p99_ttff,
        "p99_batch_latency_s": s.p99_latency_batch,
        "utilisation": s.utilisation,
        "preemptions": s.preemptions,
        "encodes_skipped": s.encodes_skipped,
        "horizon_s": horizon,
        "events": r.events,
        "failed": r.failed,
        "rejected": r.rejected,
        "wall_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------- parts
def parity(seed: int) -> list[dict[str, Any]]:
    rows = []
    for kind in (WAN_720P, QWEN_1024, FLUX_1024):
        w = Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0)
        lat = {}
        for lay in (Layout("colocated", 8), Layout("disaggregated", 8, aux=1)):
            # no embedding-cache hit: the same stage work on both sides
            mech = Mechanisms().without("embedding_cache")
            r = simulate(w, lay, mech, closed_loop=(1, 1), seed=seed)
            lat[lay.mode] = r.records[0].done - r.records[0].submitted
        rows.append(
            {
                "part": "parity",
                "workload": kind.name,
                "colocated_s": lat["colocated"],
                "disaggregated_s": lat["disaggregated"],
                "ratio": lat["disaggregated"] / lat["colocated"],
                "isolated_s": kind.isolated_s,
            }
        )
    return rows


def matrix(scales: list[int], loads: list[float], target: int, seed: int) -> list[dict]:
    rows = []
    for w in WORKLOADS:
        for g in scales:
            aux = default_aux(w, g)
            for load in loads:
                h = horizon_for(w, g, load, target)
                log(f"matrix: {w.name} {g} GPUs load {load:.2f} (aux {aux})")
                rows.append(
                    run_row("matrix", w, Layout("colocated", g), Mechanisms.none(), load, h, seed)
                )
                rows.append(
                    run_row(
                        "matrix",
                        w,
                        Layout("disaggregated", g, aux=aux),
                        Mechanisms(),
                        load,
                        h,
                        seed,
                    )
                )
    return rows


def ablation(target: int, seed: int) -> list[dict]:
    rows = []
    g, load = 64, 0.9
    aux = default_aux(MIXED, g)
    h = horizon_for(MIXED, g, load, target)
    log(f"ablation: mixed {g} GPUs load {load}")
    rows.append(
        run_row(
            "ablation",
            MIXED,
            Layout("colocated", g),
            Mechanisms.none(),
            load,
            h,
            seed,
            switch="colocated baseline",
        )
    )
    full = Mechanisms()
    rows.append(
        run_row(
            "ablation",
            MIXED,
            Layout("disaggregated", g, aux=aux),
            full,
            load,
            h,
            seed,
            switch="all on",
        )
    )
    for m in MECHS:
        rows.append(
            run_row(
                "ablation",
                MIXED,
                Layout("disaggregated", g, aux=aux),
                full.without(m),
                load,
                h,
                seed,
                switch=f"without {m}",
            )
        )
    rows.append(
        run_row(
            "ablation",
            MIXED,
            Layout("disaggregated", g, aux=aux),
            Mechanisms.none(),
            load,
            h,
            seed,
            switch="all off",
        )
    )
    return rows


def sharing(target: int, seed: int, ms: list[int]) -> list[dict]:
    rows = []
    g, load = 64, 0.9
    h = horizon_for(MIXED, g, load, target)
    for m in ms:
        log(f"sharing: {g - m} denoise : {m} aux")
        rows.append(
            run_row(
                "sharing",
                MIXED,
                Layout("disaggregated", g, aux=m),
                Mechanisms(),
                load,
                h,
                seed,
                ratio=f"{g - m}:{m}",
            )
        )
    return rows


def lightx2v(seed: int, requests: int = 100) -> list[dict]:
    """workloads.md §7.1: 100 requests, concurrency = the number of DiT workers (§9)."""
    w = Workload("qwen-4090", ((QWEN_4090, 1.0),), prompt_repeat=0.0)
    rows = []
    setups = [
        (
            "8:0 colocated (offloaded)",
            Layout("colocated", 8, small_memory=True),
            Mechanisms.none(),
            8,
        ),
        (
            "7:1 disaggregated",
            Layout("disaggregated", 8, aux=1, small_memory=True),
            Mechanisms(),
            7,
        ),
        (
            "7:1 disaggregated, weights still offloaded",
            Layout("disaggregated", 8, aux=1, small_memory=True),
            Mechanisms().without("no_offload"),
            7,
        ),
    ]
    for name, lay, mech, conc in setups:
        r = simulate(w, lay, mech, closed_loop=(conc, requests), seed=seed)
        lats = sorted(x.done - x.submitted for x in r.records)
        rows.append(
            {
                "part": "lightx2v",
                "setting": name,
                "qps": len(r.records) / r.makespan,
                "p50_latency_s": lats[len(lats) // 2],
                "p99_latency_s": lats[min(len(lats) - 1, int(0.99 * len(lats)))],
                "makespan_s": r.makespan,
            }
        )
    base = rows[0]["qps"]
    for row in rows:
        row["qps_ratio"] = row["qps"] / base
    return rows


# --------------------------------------------------------------------------- output
def pick(rows: list[dict], **kw: Any) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def ratio(rows: list[dict], key: str, workload: str, gpus: int, load: float) -> float | None:
    c = pick(rows, part="matrix", workload=workload, gpus=gpus, load=load, mode="colocated")
    d = pick(rows, part="matrix", workload=workload, gpus=gpus, load=load, mode="disaggregated")
    if c is None or d is None or not c[key]:
        return None
    return d[key] / c[key]


def fmt_util(u: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.0%}" for k, v in u.items())


def markdown(rows: list[dict]) -> str:
    out = [
        "### Single-request parity (one request alone, 8 GPUs)",
        "",
        "| kind | isolated s | colocated s | disaggregated s | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "parity"):
        out.append(
            f"| {r['workload']} | {r['isolated_s']:.2f} | {r['colocated_s']:.2f} "
            f"| {r['disaggregated_s']:.2f} | {r['ratio']:.3f} |"
        )
    out += [
        "",
        "### Colocated (C) vs disaggregated (D) at equal GPU count",
        "",
        "| workload | GPUs | load | C goodput/s | D goodput/s | goodput D/C | C P99 TTFF s "
        "| D P99 TTFF s | TTFF D/C | C util | D util (aux / denoise) | preempt |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in (x for x in rows if x["part"] == "matrix" and x["mode"] == "colocated"):
        d = pick(
            rows,
            part="matrix",
            workload=c["workload"],
            gpus=c["gpus"],
            load=c["load"],
            mode="disaggregated",
        )
        assert d is not None
        g = d["goodput_rps"] / c["goodput_rps"] if c["goodput_rps"] else float("nan")
        t = d["p99_ttff_s"] / c["p99_ttff_s"] if c["p99_ttff_s"] else float("nan")
        ttff_c = f"{c['p99_ttff_s']:.1f}" if c["p99_ttff_s"] else "-"
        ttff_d = f"{d['p99_ttff_s']:.1f}" if d["p99_ttff_s"] else "-"
        tr = f"{t:.2f}" if c["p99_ttff_s"] else "-"
        out.append(
            f"| {c['workload']} | {c['gpus']} | {c['load']:.0%} | {c['goodput_rps']:.4g} "
            f"| {d['goodput_rps']:.4g} | {g:.2f} | {ttff_c} | {ttff_d} | {tr} "
            f"| {fmt_util(c['utilisation'])} | {fmt_util(d['utilisation'])} | {d['preemptions']} |"
        )
    out += [
        "",
        "### Ablation: mixed workload, 64 GPUs, 90 % load (one switch off at a time)",
        "",
        "| setting | goodput/s | SLO met | P50 TTFF s | P99 TTFF s | P99 batch s | preempt "
        "| encodes skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "ablation"):
        out.append(
            f"| {r['switch']} | {r['goodput_rps']:.4g} | {r['slo_met']:.1%} "
            f"| {r['p50_ttff_s']:.1f} | {r['p99_ttff_s']:.1f} "
            f"| {r['p99_batch_latency_s']:.0f} | {r['preemptions']} "
            f"| {r['encodes_skipped']} |"
        )
    out += [
        "",
        "`no_offload` changes nothing on 80 GB H100s (nothing is offloaded there); its effect "
        "is in the LightX2V 4090 rows. `decode_off_dit` only removes the tiled Wan decode "
        "(+2.5 s per 1046 s job); larger denoise batches are not modelled. `all off` and "
        "`without shared_decode` give every 8-GPU node its own aux GPU (8 at 64 GPUs, not 2): "
        "fewer denoise GPUs, which 90 % load overloads.",
    ]
    out += [
        "",
        "### Decode-pool sharing ratio: mixed workload, 64 GPUs, 90 % load",
        "",
        "| denoise : aux | goodput/s | SLO met | P99 TTFF s | aux util | denoise util |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "sharing"):
        u = r["utilisation"]
        out.append(
            f"| {r['ratio']} | {r['goodput_rps']:.4g} | {r['slo_met']:.1%} "
            f"| {r['p99_ttff_s']:.1f} | {u.get('aux', 0):.0%} | {u.get('denoise', 0):.0%} |"
        )
    out += [
        "",
        "### LightX2V's 8 x RTX 4090 Qwen-Image setting (claimed 1.89x QPS)",
        "",
        "| setting | QPS | QPS ratio | P50 s | P99 s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in (x for x in rows if x["part"] == "lightx2v"):
        out.append(
            f"| {r['setting']} | {r['qps']:.3f} | {r['qps_ratio']:.2f} "
            f"| {r['p50_latency_s']:.1f} | {r['p99_latency_s']:.1f} |"
        )
    return "\n".join(out)


def plots(rows: list[dict], folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    written = []
    m = [r for r in rows if r["part"] == "matrix" and r["workload"] == "mixed"]
    scales = sorted({r["gpus"] for r in m})
    for key, label, name in (
        ("goodput_rps", "goodput (requests/s within SLO)", "goodput_vs_load.png"),
        ("throughput_rps", "throughput (requests/s)", "throughput_vs_load.png"),
        ("p99_ttff_s", "interactive P99 TTFF (s)", "p99_ttff_vs_load.png"),
    ):
        fig, axes = plt.subplots(1, len(scales), figsize=(4.2 * len(scales), 3.6), squeeze=False)
        for ax, g in zip(axes[0], scales, strict=True):
            for mode, style in (("colocated", "o--"), ("disaggregated", "s-")):
                pts = sorted((r["load"], r[key]) for r in m if r["gpus"] == g and r["mode"] == mode)
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], style, label=mode)
            ax.set_title(f"mixed workload, {g} GPUs")
            ax.set_xlabel("load (% of isolated capacity)")
            ax.set_ylabel(label)
            if key == "p99_ttff_s":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(folder, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    sh = [r for r in rows if r["part"] == "sharing"]
    if sh:
        fig, ax1 = plt.subplots(figsize=(6, 3.8))
        xs = [r["ratio"] for r in sh]
        ax1.plot(xs, [r["goodput_rps"] for r in sh], "s-", color="tab:blue", label="goodput")
        ax1.set_xlabel("denoise : aux (encode + decode) GPUs, 64 GPUs, 90 % load")
        ax1.set_ylabel("goodput (requests/s within SLO)", color="tab:blue")
        ax1.set_ylim(0, 1.15 * max(r["goodput_rps"] for r in sh))
        ax2 = ax1.twinx()
        ax2.plot(xs, [r["p99_ttff_s"] for r in sh], "o--", color="tab:red", label="P99 TTFF")
        ax2.set_ylabel("interactive P99 TTFF (s)", color="tab:red")
        ax2.set_ylim(0, 1.15 * max(r["p99_ttff_s"] for r in sh))
        ax1.grid(alpha=0.3)
        ax1.set_title("decode-pool sharing ratio N:M")
        fig.tight_layout()
        path = os.path.join(folder, "sharing_ratio.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    ab = [r for r in rows if r["part"] == "ablation"]
    if ab:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        ax.barh([r["switch"] for r in ab], [r["goodput_rps"] for r in ab], color="tab:green")
        ax.invert_yaxis()
        ax.set_xlabel("goodput (requests/s within SLO), mixed, 64 GPUs, 90 % load")
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        path = os.path.join(folder, "ablation.png")
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
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="8 and 64 GPUs, fewer requests")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into this folder")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and the mix")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    if a.quick:
        scales, loads, target = [8, 64], [0.5, 0.8, 0.95], 1200
        ms = [1, 2, 4, 8]
    else:
        scales, loads, target = [8, 64, 512], [0.3, 0.5, 0.7, 0.8, 0.9, 0.95], 5000
        ms = [1, 2, 3, 4, 6, 8, 12, 16]
    rows = parity(a.seed)
    rows += matrix(scales, loads, target, a.seed)
    rows += ablation(target, a.seed)
    rows += sharing(target, a.seed, ms)
    rows += lightx2v(a.seed)
    print(markdown(rows))
    lx = [r for r in rows if r["part"] == "lightx2v"]
    summary: dict[str, Any] = {
        "goodput_ratio_mixed": ratio(rows, "goodput_rps", "mixed", 8, 0.8),
        "p99_ttff_ratio_interactive_80pct": ratio(rows, "p99_ttff_s", "mixed", 8, 0.8),
        "lightx2v_setting_qps_ratio": lx[1]["qps_ratio"],
        "lightx2v_claimed_qps_ratio": LIGHTX2V_CLAIM,
        "lightx2v_qps_ratio_weights_still_offloaded": lx[2]["qps_ratio"],
        "single_request_latency_ratio_max": max(r["ratio"] for r in rows if r["part"] == "parity"),
        "headline_scale": "8 GPUs, 80 % load; per-scale values below",
    }
    for g in scales:
        for load in (0.8, 0.95):
            summary[f"goodput_ratio_mixed_{g}gpu_{round(load * 100)}pct"] = ratio(
                rows, "goodput_rps", "mixed", g, load
            )
            summary[f"p99_ttff_ratio_interactive_{g}gpu_{round(load * 100)}pct"] = ratio(
                rows, "p99_ttff_s", "mixed", g, load
            )
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
                "seed": a.seed,
                "scales": scales,
                "loads": loads,
                "target_requests": target,
                "slo": "interactive 3 x isolated latency, batch 2 x (simulate/costs.py)",
                "kinds": {k.name: asdict(k) for k in (WAN_720P, QWEN_1024, FLUX_1024, QWEN_4090)},
                "workloads": {w.name: {k.name: sh for k, sh in w.kinds} for w in WORKLOADS},
            },
            "rows": rows,
            "summary": summary,
            "plots": written,
            "total_seconds": total,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2, default=lambda o: asdict(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The orchestrator bench's report: the printed tables and the JSON document
(``bench/orchestrator.py``, the command, writes both).

In the order the command calls them:

- ``markdown``: the saturated, chaos and service tables, and the paired ratios.
- ``summarize``: the headline figures (the JSON's ``summary``), from the rows;
  ``worst_ratio`` is its per-policy ratio between pools.
- ``document``: the whole JSON document: machine (``machine_info``, with the CPU's
  caches from ``cpu_caches``), config, units, rows, summary, load averages.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

from orch_load import PARTS, POLICIES, POOLS
from orch_measure import ChaosRow, SaturatedRow, ServiceRow


def worst_ratio(rows: list[SaturatedRow], pool: str, rate: str = "core_decisions_per_s") -> float:
    """Per policy, ``pool``'s ``rate`` over the smallest pool's (best run over best
    run, the rows of one ``saturated_all``); the worst policy's."""
    by = {(r.policy, r.pool): getattr(r, rate) for r in rows}
    smallest = next(iter(POOLS))
    return min(by[(p, pool)] / by[(p, smallest)] for p in POLICIES)


def cpu_caches() -> dict[str, str]:
    """The CPU's model name and cache sizes as Linux reports them for CPU 0 (``L1d``,
    ``L2``, ``L3``: ``/sys/devices/system/cpu/cpu0/cache``); what is unreadable is
    left out. A 4,096-worker row's rate against a 24-worker row's follows how much
    of the fleet's state these caches hold, so a result names them."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    found["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return found
    for entry in entries:
        try:
            with open(f"{base}/{entry}/level") as f:
                level = f.read().strip()
            with open(f"{base}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{base}/{entry}/size") as f:
                size = f.read().strip()
        except OSError:
            continue
        if kind != "Instruction":
            found[f"L{level}d" if kind == "Data" else f"L{level}"] = size
    return found


def machine_info() -> dict[str, Any]:
    return {
        **cpu_caches(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "msgspec": importlib.metadata.version("msgspec"),
        "mooncake_diffusion": importlib.metadata.version("mooncake-diffusion"),
    }


def markdown(
    sat: list[SaturatedRow],
    ch: list[ChaosRow],
    svc: list[ServiceRow],
    ratios: dict[str, dict[str, dict[str, list[float]]]] | None = None,
) -> str:
    """The tables; ``ratios``: per order (``oldest``, ``newest``), saturated_all's ratios."""
    lines = [
        "| policy | pool (E/D/V workers) | finishes next | decisions | core dec/s (best) "
        "| runs min-max | loop dec/s | loop dec/CPU-s | handle p50 us | handle p99 us |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sat:
        runs = r.core_decisions_per_s_runs or [r.core_decisions_per_s]
        lines.append(
            f"| {r.policy} | {r.pool} ({r.workers}) | {r.order} | {r.decisions} "
            f"| {r.core_decisions_per_s:,.0f} | {min(runs):,.0f}-{max(runs):,.0f} "
            f"| {r.loop_decisions_per_s:,.0f} | {r.loop_cpu_decisions_per_s:,.0f} "
            f"| {r.handle_us_p50:.1f} | {r.handle_us_p99:.1f} |"
        )
    for order, by_policy in (ratios or {}).items():
        for policy, rs in by_policy.items():
            parts = [
                f"{name}/smallest {statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]"
                for name, v in rs.items()
            ]
            what = f"{policy}, {order} first, paired per repeat, median [min, max]"
            lines.append(f"\n{what}: {'; '.join(parts)}")
    lines += [
        "",
        "| policy | requests | completed | failed | cancelled | lost | dup | deaths "
        "| requeued | late dropped | virtual h | core dec/s | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in ch:
        lines.append(
            f"| {c.policy} | {c.requests} | {c.completed} | {c.failed} | {c.cancelled} "
            f"| {c.lost} | {c.duplicate_completions} | {c.worker_deaths} | {c.requeued} "
            f"| {c.late_results_dropped} | {c.virtual_hours:.2f} "
            f"| {c.core_decisions_per_s:,.0f} | {c.wall_seconds:.1f} |"
        )
    lines += [
        "",
        "| service (submit -> dispatch), open loop | client | workers | offered /s "
        "| achieved /s | requests | p50 ms | p90 ms | p99 ms | max ms | send lag p99 ms "
        "| dispatched | wake late p99 / max ms | wakes > 2 ms late |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in svc:
        offered = f"{r.offered_per_s:,.0f}" if r.offered_per_s else "one at a time"
        lines.append(
            f"| {'journal (SQLite WAL)' if r.journal else 'no journal'} "
            f"| {r.client}{', front process' if r.front == 'process' else ''}"
            f"{', beside the wake probe' if r.probe else ''} "
            f"| {r.workers} "
            f"| {offered} | {r.achieved_per_s:,.0f} | {r.requests} "
            f"| {r.rtt_ms_p50:.2f} | {r.rtt_ms_p90:.2f} | {r.rtt_ms_p99:.2f} "
            f"| {r.rtt_ms_max:.2f} | {r.send_lag_ms_p99:.2f} | {r.dispatched} "
            + (
                f"| {r.wake_late_ms_p99:.2f} / {r.wake_late_ms_max:.2f} | {r.wake_late_over_2ms} |"
                if r.wake_late_ms_p99 is not None and r.wake_late_ms_max is not None
                else "| - | - |"
            )
        )
    return "\n".join(lines)


def summarize(
    sat: list[SaturatedRow],
    newest: list[SaturatedRow],
    ratios: dict[str, dict[str, list[float]]],
    newest_ratios: dict[str, dict[str, list[float]]],
    ch: list[ChaosRow],
    svc: list[ServiceRow],
) -> dict[str, Any]:
    """The JSON's ``summary``: the slowest saturated row, the worst policy's ratios
    between pools (``sat``: the saturated part; ``newest``: its diagnostic), the chaos
    runs' lost and duplicated outcomes, and the service rows' round trips by row.
    Raises ``StopIteration`` when ``svc`` lacks one of the command's rows."""
    largest = list(POOLS)[-1]
    jsvc = next(
        r
        for r in svc
        if r.journal and r.offered_per_s and r.client == "raw" and r.front == "loop" and not r.probe
    )
    psvc = next(r for r in svc if r.probe)
    fsvc = next(r for r in svc if r.front == "process")
    lsvc = next(r for r in svc if r.client == "library")
    return {
        "decisions_per_s": min(r.core_decisions_per_s for r in sat),
        # per policy, best run over best run; the worst policy (paired ratios below)
        "decisions_per_s_ratio_largest_to_smallest": worst_ratio(sat, largest),
        "decisions_per_s_ratio_fleet_to_smallest": worst_ratio(sat, "fleet"),
        "decisions_per_s_ratios_paired": ratios,
        # the diagnostic: the item dispatched last finishes first (module docstring)
        "decisions_per_s_ratio_largest_to_smallest_newest_first": worst_ratio(newest, largest),
        "decisions_per_s_ratios_paired_newest_first": newest_ratios,
        "handle_us_p99": max(r.handle_us_p99 for r in sat),
        "loop_decisions_per_s": min(r.loop_decisions_per_s for r in sat),
        "loop_cpu_decisions_per_s": min(r.loop_cpu_decisions_per_s for r in sat),
        "loop_cpu_ratio_largest_to_smallest": worst_ratio(sat, largest, "loop_cpu_decisions_per_s"),
        "lost_requests": sum(c.lost for c in ch),
        "duplicate_completions": sum(c.duplicate_completions for c in ch),
        "service_rtt_p50_ms": jsvc.rtt_ms_p50,
        "service_rtt_p99_ms": jsvc.rtt_ms_p99,
        "service_rtt_p50_ms_front_process": fsvc.rtt_ms_p50,
        "service_rtt_p99_ms_front_process": fsvc.rtt_ms_p99,
        "service_rtt_p99_ms_no_journal": next(r.rtt_ms_p99 for r in svc if not r.journal),
        "service_rtt_p50_ms_library_client": lsvc.rtt_ms_p50,
        "service_rtt_p99_ms_library_client": lsvc.rtt_ms_p99,
        "service_rtt_p50_ms_one_at_a_time": next(r.rtt_ms_p50 for r in svc if not r.offered_per_s),
        "service_rtt_p99_ms_one_at_a_time": next(r.rtt_ms_p99 for r in svc if not r.offered_per_s),
        "service_achieved_per_s": jsvc.achieved_per_s,
        # the diagnostic row: that row again beside the wake probe, and the probe's
        # figures (the machine's own wake-up lateness meanwhile)
        "service_rtt_p99_ms_with_probe": psvc.rtt_ms_p99,
        "service_wake_late_ms_p99": psvc.wake_late_ms_p99,
        "service_wake_late_ms_max": psvc.wake_late_ms_max,
        "service_wake_late_over_2ms": psvc.wake_late_over_2ms,
        "service_workers": jsvc.workers,
    }


def document(
    config: dict[str, Any],
    sat: list[SaturatedRow],
    ch: list[ChaosRow],
    svc: list[ServiceRow],
    summary: dict[str, Any],
    load_start: tuple[float, float, float],
    total: float,
) -> dict[str, Any]:
    """The JSON document the command writes (``--json``): ``sat``, every saturated
    row (the diagnostic's included), then the chaos and service rows; ``summary``
    from ``summarize``; ``load_start``, the load averages when the run began. Reads
    this machine's description and its load averages now, at the run's end."""
    return {
        "bench": "orchestrator",
        "machine": machine_info(),
        "config": config,
        "units": {
            "decisions_per_s": "Dispatch actions per second inside Orchestrator.handle "
            "(slowest saturated row; a row is the best of its repeats)",
            "handle_us": "microseconds per handle() call",
            "decisions_per_s_ratio_largest_to_smallest": "per policy, the largest pool's "
            "decisions/s over the smallest's; the worst policy",
            "handle_us_p99": "the largest handle() p99 of any saturated row",
            "decisions_per_s_ratio_largest_to_smallest_newest_first": "the same ratio "
            "with the item dispatched last finishing first (its state in cache): a "
            "diagnostic, not the target",
            "service_rtt": "ms from sending a submission to its encode item arriving at "
            "a worker, open loop, journal on, the raw client (raw_open_loop); "
            "_library_client: OrchestratorClient in 8 threads (library_open_loop); "
            "_front_process: the same as service_rtt with --front-process (the HTTP "
            "front in a child process); _with_probe: the same as service_rtt beside "
            "the wake probe (a diagnostic)",
            "service_wake_late": "ms by which the wake probe's 2 ms sleeps overran "
            "during the _with_probe row (p99, max) and how many overran by more "
            "than 2 ms: the machine's own stalls",
        },
        "rows": [{"part": PARTS[r.order], **asdict(r)} for r in sat]
        + [{"part": "chaos", **asdict(c)} for c in ch]
        + [{"part": "service", **asdict(r)} for r in svc],
        "summary": summary,
        # 1/5/15-minute load averages: how busy the machine was (its 2 CPUs are shared)
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "total_seconds": total,
    }

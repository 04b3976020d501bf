"""Cache misses per decision, counted: the saturated workload of ``bench/orchestrator.py``
under Valgrind's cache simulator, so that what a larger pool costs in memory is a count
that does not move with the machine's other jobs.

Run ``uv run python bench/misses.py [--json PATH]`` (needs ``valgrind``: ``apt-get
install valgrind``). For each routing policy, on the smallest and largest pools
(``small``, 24 workers; ``xl``, 4,096) and on the largest again as the newest-first
diagnostic runs it (the item dispatched last finishes first, so the state a decision
touches was touched a few events before: what it leaves is the work, not the memory),
the saturated part's run (``saturated`` in ``bench/orch_measure.py``: the same
workload, default seed and warm-up) is made twice in a child process under ``valgrind
--tool=cachegrind``, once to 2,000 decisions and once to 12,000; the difference between
the two runs' counts is the cost of the 10,000 decisions between, without the
start-up, the registration, the warm-up and the exit that both runs share (the child
skips the percentiles ``saturated`` takes after its loop: sorting every sample grows
with the run). Per decision: instructions (``I refs``), data reads and writes (``D refs``)
and misses in a simulated 1 MiB, 16-way data cache with 64-byte lines (``--D1``: the
size of this machine's second-level cache per core, what a decision's state must fit
in to be read without going to the shared L3 or to memory). The simulation is LRU with
no prefetcher, and counts the driver's work as well as ``Orchestrator.handle``'s (the
same on both pools); read the misses as a count of cold reads, not as a time. With
``PYTHONHASHSEED=0`` the misses repeat from run to run within about 1 % and the
instructions within about 2 % (objects hashed by address still move), so two cores
compare without the noise that timing them on a shared machine has: a 4,096-worker
timing moves 15-20 % with the host's other jobs. ``--quick`` runs the same (there are
no repeats to drop). About six minutes, two children at a time. ``--smoke`` only
checks that it runs (the test suite's bench smoke): one policy on the smallest pool,
200 and 400 decisions, no figures across pools.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
POLICIES = ("round_robin", "least_loaded", "affinity")
#: (pool, which dispatched item finishes next): the smallest and largest pools as the
#: saturated part runs them, and the largest as its newest-first diagnostic does (the
#: state a decision touches was touched a few events before: what is left is work)
CASES = (("small", "oldest"), ("xl", "oldest"), ("xl", "newest"))
DECISIONS = (2_000, 12_000)  # the two runs; the counts of the decisions between are kept
#: ``--smoke``: the two runs of a check that the bench runs (its counts mean little)
SMOKE_DECISIONS = (200, 400)
SEED = 0  # bench/orchestrator.py's default --seed
CACHE = "1048576,16,64"  # the simulated data cache: 1 MiB, 16-way, 64-byte lines
COUNTS = {"I": "instructions", "D": "data_refs", "D1": "misses"}
_LINE = re.compile(r"^==\d+== (I|D|D1) +(?:refs|misses): +([\d,]+)", re.M)


def parse_counts(stderr: str) -> dict[str, int]:
    """The program totals in cachegrind's summary (``I refs``, ``D refs``, ``D1
    misses``) as ``instructions``, ``data_refs``, ``misses``; raises ``ValueError``
    naming what is missing (a child that failed prints no summary)."""
    found = {COUNTS[k]: int(v.replace(",", "")) for k, v in _LINE.findall(stderr)}
    lost = [name for name in COUNTS.values() if name not in found]
    if lost:
        raise ValueError(f"no {', '.join(lost)} in cachegrind's output")
    return found


def child(policy: str, pool: str, order: str, decisions: int) -> int:
    """The run valgrind watches: one saturated run (the orchestrator bench's default
    seed); prints its decisions and events."""
    sys.path.insert(0, str(HERE))
    import orch_measure as bench  # this folder: the child only (saturated, its pools)

    if order not in bench.PARTS or pool not in bench.POOLS:
        print(
            f"order must be one of {', '.join(bench.PARTS)}; pool one of {', '.join(bench.POOLS)}",
            file=sys.stderr,
        )
        return 2
    bench.log = lambda msg: None
    # the percentiles saturated() takes after its loop sort every sample: work that
    # grows with the run, which the subtraction would count per decision
    bench.statistics = types.SimpleNamespace(quantiles=lambda data, n: [0.0] * (n - 1))
    row, _ = bench.saturated(policy, pool, decisions, SEED, order)
    print(json.dumps({"decisions": row.decisions, "events": row.events}))
    return 0


def valgrind_version() -> str:
    """``valgrind --version``'s answer, or why there is none."""
    try:
        return subprocess.run(
            ["valgrind", "--version"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


def counted(policy: str, pool: str, order: str, decisions: int) -> dict[str, Any]:
    """One child under cachegrind; its counts and its own report of the run."""
    cmd = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=yes",
        f"--D1={CACHE}",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        policy,
        pool,
        order,
        str(decisions),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.splitlines()[-15:])
        raise RuntimeError(
            f"{policy}/{pool}/{order}/{decisions}: child exited {p.returncode}:\n{tail}"
        )
    return {**parse_counts(p.stderr), **json.loads(p.stdout.strip().splitlines()[-1])}


def per_decision(short: dict[str, Any], long: dict[str, Any]) -> dict[str, float]:
    """Each count's difference between the two runs over their decisions' difference."""
    n = long["decisions"] - short["decisions"]
    if n <= 0:
        raise ValueError(f"the longer run made no more decisions ({n})")
    return {k: (long[k] - short[k]) / n for k in (*COUNTS.values(), "events")}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "### Misses per decision (a simulated 1 MiB cache)",
        "",
        "| policy | pool (workers) | finishes next | decisions counted | instructions / decision "
        "| data refs / decision | misses / decision (1 MiB cache) | events / decision |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['pool']} ({r['workers']}) | {r['order']} | {r['decisions']} "
            f"| {r['instructions']:,.0f} | {r['data_refs']:,.0f} | {r['misses']:.2f} "
            f"| {r['events']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="the same runs (counts do not vary)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"that it runs, not a measurement: {POLICIES[0]} on the {CASES[0][0]} pool only, "
        f"{SMOKE_DECISIONS} decisions (no summary across pools)",
    )
    ap.add_argument(
        "--child", nargs=4, metavar=("POLICY", "POOL", "ORDER", "N"), help=argparse.SUPPRESS
    )
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child[0], a.child[1], a.child[2], int(a.child[3]))
    if shutil.which("valgrind") is None:
        print("bench/misses.py needs valgrind: apt-get install valgrind", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    import orch_load as bench  # its pools and log
    from orch_report import machine_info

    started = time.monotonic()
    policies = POLICIES[:1] if a.smoke else POLICIES
    decisions = SMOKE_DECISIONS if a.smoke else DECISIONS
    cases = CASES[:1] if a.smoke else CASES
    jobs = [(p, pool, order, n) for p in policies for pool, order in cases for n in decisions]
    results: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, min(2, os.cpu_count() or 1))) as ex:
        futures = {ex.submit(counted, *job): job for job in jobs}
        try:
            for i, f in enumerate(concurrent.futures.as_completed(futures), 1):
                job = futures[f]
                results[job] = f.result()
                policy, pool, order, n = job
                bench.log(f"{i}/{len(jobs)}: {policy}, {pool} pool, {order} first, {n} decisions")
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)  # the children not started yet
            raise
    rows = []
    for policy in policies:
        for pool, order in cases:
            short, long = (results[(policy, pool, order, n)] for n in decisions)
            rows.append(
                {
                    "policy": policy,
                    "pool": pool,
                    "workers": "/".join(str(n) for n in bench.POOLS[pool]),
                    "order": order,
                    "decisions": long["decisions"] - short["decisions"],
                    **per_decision(short, long),
                }
            )
    by = {(r["policy"], r["pool"], r["order"]): r for r in rows}
    small, large, hot = CASES
    summary: dict[str, float] = {}
    for policy in policies:
        for pool, order in cases:
            name = pool if order == "oldest" else f"{pool}_newest_first"
            summary[f"misses_per_decision_{name}_{policy}"] = round(
                by[(policy, pool, order)]["misses"], 2
            )
    if cases == CASES:  # the figures across pools (not in a --smoke run)
        summary["misses_per_decision_largest_minus_smallest_max"] = round(
            max(by[(p, *large)]["misses"] - by[(p, *small)]["misses"] for p in policies), 2
        )
        summary["instructions_ratio_largest_to_smallest_max"] = round(
            max(
                by[(p, *large)]["instructions"] / by[(p, *small)]["instructions"] for p in policies
            ),
            3,
        )
        summary["instructions_ratio_newest_to_oldest_first_largest_max"] = round(
            max(by[(p, *hot)]["instructions"] / by[(p, *large)]["instructions"] for p in policies),
            3,
        )
    print(markdown(rows))
    for k, v in summary.items():
        print(f"{k}: {v}")
    if a.json:
        doc = {
            "bench": "misses",
            "machine": {**machine_info(), "valgrind": valgrind_version()},
            "config": {
                "quick": a.quick,
                "smoke": a.smoke,
                "decisions": list(decisions),
                "cache": CACHE,
            },
            "units": {
                "misses": "misses per decision in the simulated data cache (1 MiB, 16-way, "
                "64-byte lines, LRU, no prefetch), over the decisions between the two runs",
                "instructions": "instructions per decision, the driver's included",
            },
            "rows": rows,
            "summary": summary,
            "markdown": markdown(rows),
            "total_seconds": round(time.monotonic() - started, 1),
        }
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

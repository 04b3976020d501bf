"""Orchestrator benchmark: how fast the in-process core decides, and that chaos loses nothing.

Run ``uv run python bench/orchestrator.py [--quick] [--json PATH] [--seed N]``. The
saturated, newest-first and chaos parts need no cluster and no other process: the
deterministic core (``mooncake_diffusion.orchestrator``) is driven in this process under
a virtual clock; the service part starts the orchestrator and a stand-in fleet. Parts:

    saturated  A steady workload that never runs out of work: a backlog of requests
               (70 % interactive, 30 % batch; half with cached embeddings, so they skip
               Encode) is topped up after every event, and the oldest dispatched item
               finishes next (``ItemDone``), the virtual clock advancing so that an
               item holds its credit about 2 s whatever the pool's size (a larger
               pool completes more items per second); every worker heartbeats every
               10 virtual seconds, the fleet's beats spread evenly over the period,
               so heartbeats per decision do not depend on the size. (Denoise runs
               about half its workers at any size: a denoise dispatch reserves a
               decode credit, and the decode pool has as many credits as denoise.)
               A *decision* is one ``Dispatch`` action. Timed with ``time.perf_counter`` after a
               warm-up (registration, and the first backlog until as many requests
               have completed, are not timed; each run starts from a collected
               heap): ``core`` is the time spent inside
               ``Orchestrator.handle`` only; ``loop`` adds this driver (building
               events, bookkeeping); ``loop dec/CPU-s`` divides by the CPU time this
               thread got in the loop (``time.thread_time``): on a shared machine
               other jobs take the CPU for whole scheduler slices (4 ms events in a
               5 us workload), which wall-clock figures count and this one does not.
               Per routing policy and per pool size (workers per
               stage, encode/denoise/decode, with 4/1/4 credits each), from 24 workers
               (``small``) to 4,096 (``xl``). Each row is run ``repeats`` times (3 in
               ``--quick``, 5 in full), a policy's pools back to back in each repeat,
               and a row reports its best run (other jobs on the machine only ever
               slow a run down; every run's figure is kept) and the handle
               percentiles of its least disturbed run; the ratio between pools is
               also given paired, per repeat (median and range).
    newest first
               A diagnostic of the saturated part, smallest and largest pool only:
               the same workload, but the item dispatched last finishes first, so the
               request, worker and index entries a decision touches were touched a
               few events before (in the CPU's cache), where in ``saturated`` they
               were last touched about as many decisions ago as the pool has credits
               (7,168 on ``xl``: out of cache). One credit turns over while the
               others stay held; the queue (FIFO, its requests out of cache in both)
               and every index are as large. Its ratio largest/smallest against the
               saturated one says how much of the larger pool's cost is memory, not
               work that grows with the pool.
    service    The submit-to-dispatch round trip through the real service over loopback,
               open loop: ``mooncake-diffusion orchestrator`` runs as its own process
               (with and without its SQLite journal) with 1,024 workers registered
               (64 encode, 768 denoise, 192 decode: two child processes, the encode
               workers in one, a DEALER socket per worker waited on with epoll,
               heartbeating, finishing every item at once); this
               process offers 1,000 submissions/s over HTTP, request ``i`` due at
               ``t0 + i/rate`` whatever the answers, from the ``raw`` client (one
               thread, 16 keep-alive connections, pre-built requests, each stamped
               just before its send) and, in one row for comparison, from the
               ``library`` client (``OrchestratorClient`` in 8 threads, whose
               sends wait for each other's Python under one interpreter lock and
               whose own time is counted in its round trips). RTT: from sending a
               submission to its encode item arriving at a worker
               (``time.monotonic``, one clock for both processes): HTTP in, journal
               commit, ZeroMQ out. ``achieved /s`` and ``send lag`` say whether the
               offered rate was kept (a lag of seconds: this machine could not).
               A row sends one submission at a time (journal on, raw client): the
               round trip without queueing. A last row, a diagnostic, repeats the
               first (journal on, raw client, 1,000/s) with a probe process beside
               it that sleeps 2 ms at a time and notes how late each wake-up comes
               (``wake late``): a process that needs almost no CPU is woken late
               only when the machine is not running it (other threads hold both
               CPUs, or the hypervisor took the virtual CPU), and a round trip
               through three processes is no steadier than that. The probe's
               wake-ups cost the round trip itself (p99 about 0.5 ms higher in five
               alternated pairs), so no other row has it. Every submission must be
               answered 201, or the bench stops.
    chaos      ``Simulation`` (``simulate/faults.py``) of 10,000 requests with random
               worker deaths (half reported by a supervisor, half found by the
               heartbeat deadline; some dead workers' results arrive late), retryable
               item failures and client cancels, run to completion. ``lost``: requests
               that never reached an outcome; ``dup``: outcomes surfaced to a client
               twice for one request. Both must be 0. ``core dec/s`` is decisions per
               second of time inside ``handle`` during that run (heartbeats included).

Reading the output: decisions/s are measured on this machine and are noise-prone in
absolute terms (a shared 2-vCPU VM); compare rows of one run. The handle p50/p99 are
per-event latencies inside the core, in microseconds, over every event of the row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from orch_load import CHAOS_REQUESTS, FLEET, POLICIES, SERVICE_RATE, fleet_agent, log, wake_probe
from orch_measure import chaos, saturated_all, service_rtt
from orch_report import document, markdown, summarize


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # the whole docstring: what each part measures (the run's output points here)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer decisions and repeats, one chaos run (~50 s)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="that it runs, not a measurement: --quick's parts with 1,000 decisions, one "
        "repeat and 1 s service runs",
    )
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads")
    p.add_argument("--fleet-agent", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--wake-probe", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.fleet_agent:
        return fleet_agent(*a.fleet_agent)
    if a.wake_probe:
        return wake_probe()
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    quick = a.quick or a.smoke
    decisions, repeats = (1_000, 1) if a.smoke else (10_000, 3) if quick else (40_000, 5)
    sat, ratios = saturated_all(decisions, repeats, a.seed)
    newest, newest_ratios = saturated_all(decisions, repeats, a.seed, "newest")
    ch = []
    for policy in ("affinity",) if quick else POLICIES:
        log(f"chaos: {CHAOS_REQUESTS} requests, {policy}")
        ch.append(chaos(policy, a.seed))
    svc = []
    with tempfile.TemporaryDirectory() as tmp:
        seconds = 1.0 if a.smoke else 3.0 if quick else 10.0
        for journal, client, fp in (
            (True, "raw", False),
            (True, "raw", True),
            (False, "raw", False),
            (True, "library", False),
        ):
            log(
                f"service: {SERVICE_RATE:.0f} submissions/s for {seconds:g} s, open loop, "
                f"{sum(FLEET.values())} workers, journal {'on' if journal else 'off'}, "
                f"{client} client, HTTP front {'in a process' if fp else 'on the driver loop'}"
            )
            n = int(SERVICE_RATE * seconds)
            svc.append(service_rtt(SERVICE_RATE, n, journal, tmp, client, fp))
        log("service: one submission at a time, journal on, raw client")
        svc.append(service_rtt(None, 50 if a.smoke else 300 if quick else 2000, True, tmp))
        log("service: the first row again, beside a probe of the machine's wake-ups")
        svc.append(service_rtt(SERVICE_RATE, n, True, tmp, probe=True))
    total = time.perf_counter() - t0
    print(markdown(sat + newest, ch, svc, {"oldest": ratios, "newest": newest_ratios}))
    print(f"\ntotal {total:.1f} s; dec/s = Dispatch actions per second (see --help)")
    print(f"load average at start {load_start}, at end {os.getloadavg()}")
    summary = summarize(sat, newest, ratios, newest_ratios, ch, svc)
    if a.json:
        config = {
            "quick": a.quick,
            "smoke": a.smoke,
            "seed": a.seed,
            "decisions_per_run": decisions,
            "repeats": repeats,
        }
        doc = document(config, sat + newest, ch, svc, summary, load_start, total)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    ok = summary["lost_requests"] == 0 and summary["duplicate_completions"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

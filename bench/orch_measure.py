"""The orchestrator bench's measurement: each part run and timed, a row per run
(``bench/orchestrator.py``, the command, describes what each part measures).

In the order the command calls them:

- ``saturated_all`` (twice: ``order="oldest"``, the saturated part, then ``"newest"``,
  the diagnostic): every policy and pool ``repeats`` times through ``saturated``, one
  run of the in-process core under a virtual clock; ``SaturatedRow``s and the paired
  per-repeat ratios between pools.
- ``chaos``: one ``Simulation`` run to completion per policy; a ``ChaosRow``.
- ``service_rtt``: one open-loop row against the real service in its own process, with
  the ``orch_load`` fleet agents (and wake probe) as children of the command; a
  ``ServiceRow``. Raises ``RuntimeError`` when a submission was not accepted.

The rows are plain dataclasses; ``orch_report`` turns them into tables and JSON.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from orch_load import (
    BEAT_SECONDS,
    CHAOS_REQUESTS,
    CREDITS,
    FLEET,
    ITEM_SECONDS,
    PARTS,
    POLICIES,
    POOLS,
    library_open_loop,
    log,
    raw_open_loop,
)

from mooncake_diffusion.orchestrator import (
    STAGES,
    Dispatch,
    Event,
    Heartbeat,
    ItemDone,
    Orchestrator,
    OrchestratorConfig,
    RegisterWorker,
    RequestCompleted,
    Submit,
    VirtualClock,
    create_policy,
)
from mooncake_diffusion.simulate import SimConfig, Simulation

#: the command the service part runs its children from (``--fleet-agent``,
#: ``--wake-probe``)
COMMAND = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orchestrator.py")


@dataclass
class SaturatedRow:
    policy: str
    pool: str
    workers: str
    events: int
    decisions: int
    completed: int
    core_seconds: float
    loop_seconds: float
    core_decisions_per_s: float
    loop_decisions_per_s: float
    handle_us_p50: float
    handle_us_p99: float
    repeats: int = 1
    core_decisions_per_s_runs: list[float] = field(default_factory=list)
    #: decisions per second of this thread's CPU time in the timed loop (the driver
    #: included): blind to the time other jobs take the CPU away, so steadier here
    loop_cpu_decisions_per_s: float = 0.0
    #: which dispatched item finishes next: "oldest" (saturated) or "newest" (diagnostic)
    order: str = "oldest"


@dataclass
class ChaosRow:
    policy: str
    requests: int
    completed: int
    failed: int
    cancelled: int
    lost: int
    duplicate_completions: int
    worker_deaths: int
    requeued: int
    late_results_dropped: int
    dispatches: int
    events: int
    virtual_hours: float
    core_decisions_per_s: float
    wall_seconds: float


# --------------------------------------------------------------------------- saturated
def saturated(
    policy: str, pool: str, decisions: int, seed: int, order: str = "oldest"
) -> tuple[SaturatedRow, list[float]]:
    """One run of the saturated workload; the row and its per-event ``handle`` seconds.
    ``order``: the oldest dispatched item finishes next, or (``newest``) the one
    dispatched last (see the module docstring). Starts from a collected heap: the
    previous run's core is garbage (its requests and workers reference each other),
    which the collector would otherwise walk inside this run's timed loop."""
    gc.collect()
    rng = random.Random(seed)
    clock = VirtualClock()
    core = Orchestrator(
        OrchestratorConfig(heartbeat_timeout=60.0), clock=clock, policy=create_policy(policy)
    )
    samples: list[float] = []
    pending: deque[Dispatch] = deque()
    counts = {"decisions": 0, "completed": 0}
    perf = time.perf_counter
    oldest = order == "oldest"

    def feed(ev: Event) -> None:
        t0 = perf()
        actions = core.handle(ev)
        samples.append(perf() - t0)
        for a in actions:
            if type(a) is Dispatch:
                counts["decisions"] += 1
                pending.append(a)
            elif type(a) is RequestCompleted:
                counts["completed"] += 1

    workers: list[str] = []
    for stage, n in zip(STAGES, POOLS[pool], strict=True):
        for i in range(n):
            wid = f"{stage}-{i}"
            workers.append(wid)
            labels = {"node": f"n{i % 8}", "rail": str(i % 4)}
            feed(RegisterWorker(wid, stage, CREDITS[stage], labels))
    credits = sum(n * CREDITS[s] for s, n in zip(STAGES, POOLS[pool], strict=True))
    backlog = 2 * credits
    step = ITEM_SECONDS / credits  # virtual time per completion: every credit turns over alike
    submitted = 0
    beats = 0  # heartbeats sent; worker i beats at i/n of every 10 s period: spread out
    warmup = backlog  # requests completed before timing starts: the first fill drained
    done_before = 0  # requests completed before the timed part
    t_loop, c_loop = perf(), time.thread_time()
    while warmup or counts["decisions"] < decisions:
        if warmup and counts["completed"] >= warmup:
            counts["decisions"] = counts["completed"] = warmup = 0  # timed from here
            done_before = submitted - backlog  # so the backlog stays topped up
            samples.clear()
            t_loop, c_loop = perf(), time.thread_time()
        while submitted - done_before - counts["completed"] < backlog:
            cls = "interactive" if rng.random() < 0.7 else "batch"
            cached = b"emb-cached-handle" if rng.random() < 0.5 else None
            feed(Submit(f"r{submitted}", cls, params=b"p" * 64, cached_embeddings=cached))
            submitted += 1
        d = pending.popleft() if oldest else pending.pop()
        clock.advance(step)
        it = d.item
        feed(ItemDone(d.worker_id, it.request_id, it.stage, it.attempt, b"h" * 200))
        n = len(workers)
        while clock.now() >= (beats // n + (beats % n) / n) * BEAT_SECONDS:
            feed(Heartbeat(workers[beats % n]))
            beats += 1
    loop_s = perf() - t_loop
    cpu_s = time.thread_time() - c_loop
    core_s = sum(samples)
    q = statistics.quantiles(samples, n=100)
    row = SaturatedRow(
        policy=policy,
        pool=pool,
        workers="/".join(str(n) for n in POOLS[pool]),
        events=len(samples),
        decisions=counts["decisions"],
        completed=counts["completed"],
        core_seconds=core_s,
        loop_seconds=loop_s,
        core_decisions_per_s=counts["decisions"] / core_s,
        loop_decisions_per_s=counts["decisions"] / loop_s,
        handle_us_p50=q[49] * 1e6,
        handle_us_p99=q[98] * 1e6,
        loop_cpu_decisions_per_s=counts["decisions"] / cpu_s,
        order=order,
    )
    return row, samples


def saturated_all(
    decisions: int, repeats: int, seed: int, order: str = "oldest"
) -> tuple[list[SaturatedRow], dict[str, dict[str, list[float]]]]:
    """Every (policy, pool) ``repeats`` times, the pools of one policy back to back in
    each repeat (their order flipped every other repeat), so a ratio between pools is
    taken within one stretch of machine noise. A row: its best run's decisions/s
    (the least disturbed, as ``timeit`` takes the best: other jobs only ever slow a
    run down) with every run's in ``core_decisions_per_s_runs``, sums of its counts
    and seconds, and the handle percentiles of its least disturbed run (the lowest
    p99). Also returns, per policy, the paired per-repeat ratios
    ``largest/smallest`` and ``fleet/smallest``. ``order="newest"``: the diagnostic,
    the smallest and largest pools only, and ``largest/smallest`` alone."""
    runs: dict[tuple[str, str], list[tuple[SaturatedRow, list[float]]]] = {}
    pools = list(POOLS) if order == "oldest" else [next(iter(POOLS)), list(POOLS)[-1]]
    for r in range(repeats):
        for policy in POLICIES:
            for pool in pools if r % 2 == 0 else pools[::-1]:
                what = f"{policy}, {pool} pool, {decisions} decisions (repeat {r + 1})"
                log(f"{PARTS[order]}: {what}")
                row = saturated(policy, pool, decisions, seed, order)
                runs.setdefault((policy, pool), []).append(row)
    rows = []
    for pool in pools:
        for policy in POLICIES:
            rs = runs[(policy, pool)]
            calm = min((row for row, _ in rs), key=lambda row: row.handle_us_p99)
            first = rs[0][0]
            dps = [row.core_decisions_per_s for row, _ in rs]
            rows.append(
                SaturatedRow(
                    policy=policy,
                    pool=pool,
                    workers=first.workers,
                    events=sum(row.events for row, _ in rs),
                    decisions=sum(row.decisions for row, _ in rs),
                    completed=sum(row.completed for row, _ in rs),
                    core_seconds=sum(row.core_seconds for row, _ in rs),
                    loop_seconds=sum(row.loop_seconds for row, _ in rs),
                    core_decisions_per_s=max(dps),
                    loop_decisions_per_s=max(row.loop_decisions_per_s for row, _ in rs),
                    loop_cpu_decisions_per_s=max(row.loop_cpu_decisions_per_s for row, _ in rs),
                    handle_us_p50=calm.handle_us_p50,
                    handle_us_p99=calm.handle_us_p99,
                    repeats=len(rs),
                    core_decisions_per_s_runs=dps,
                    order=order,
                )
            )
    ratios: dict[str, dict[str, list[float]]] = {}
    named = {"largest": pools[-1]}
    if "fleet" in pools:
        named["fleet"] = "fleet"
    for policy in POLICIES:
        small = [row.core_decisions_per_s for row, _ in runs[(policy, pools[0])]]
        ratios[policy] = {
            name: [
                row.core_decisions_per_s / s
                for (row, _), s in zip(runs[(policy, pool)], small, strict=True)
            ]
            for name, pool in named.items()
        }
    return rows, ratios


# --------------------------------------------------------------------------- chaos
def chaos(policy: str, seed: int) -> ChaosRow:
    cfg = SimConfig(
        requests=CHAOS_REQUESTS,
        seed=seed,
        arrival_rate=5.0,  # about 85 % of the denoise pool's capacity
        workers={"encode": 4, "denoise": 32, "decode": 8},
        credits={"encode": 4, "denoise": 1, "decode": 8},
        nodes=8,
        death_rate=0.02,
        failure_rate=0.01,
        cancel_share=0.02,
    )
    t0 = time.perf_counter()
    sim = Simulation(
        cfg,
        OrchestratorConfig(max_attempts=5, heartbeat_timeout=5.0),
        policy=create_policy(policy),
        timer=time.perf_counter,
    )
    rep = sim.run()
    wall = time.perf_counter() - t0
    return ChaosRow(
        policy=policy,
        requests=rep.submitted,
        completed=rep.completed,
        failed=rep.failed,
        cancelled=rep.cancelled,
        lost=rep.lost,
        duplicate_completions=rep.duplicate_completions,
        worker_deaths=rep.worker_deaths,
        requeued=rep.requeued,
        late_results_dropped=rep.rejected.get("stale_attempt", 0),
        dispatches=rep.dispatches,
        events=rep.events,
        virtual_hours=rep.virtual_seconds / 3600,
        core_decisions_per_s=rep.dispatches / rep.core_seconds,
        wall_seconds=wall,
    )


# --------------------------------------------------------------------------- service
@dataclass
class ServiceRow:
    journal: bool
    client: str
    workers: int
    offered_per_s: float
    achieved_per_s: float
    requests: int
    rtt_ms_p50: float
    rtt_ms_p90: float
    rtt_ms_p99: float
    rtt_ms_max: float
    send_lag_ms_p99: float
    dispatched: int
    #: where the HTTP front ran: ``loop`` (the default: on the driver's event loop, in
    #: the service's process; ``thread`` in results before it) or ``process``
    #: (``--front-process``: a child process over the bridge)
    front: str = "loop"
    #: the machine's own wake-up lateness while the row ran (``wake_probe``): p99 and
    #: max ms, and how many wake-ups came more than 2 ms late (None: no probe beside it)
    wake_late_ms_p99: float | None = None
    wake_late_ms_max: float | None = None
    wake_late_over_2ms: int | None = None
    #: the row ran beside the wake probe (a diagnostic: the probe's wake-ups cost it)
    probe: bool = False


def service_rtt(
    rate: float | None,
    total: int,
    journal: bool,
    tmp: str,
    client: str = "raw",
    front_process: bool = False,
    probe: bool = False,
) -> ServiceRow:
    """Open loop: ``total`` submissions at ``rate``/s over HTTP (``rate=None``: one at
    a time, each sent when the last was answered), from ``client``: ``raw``
    (``raw_open_loop``: one thread, keep-alive sockets, pre-built requests) or
    ``library`` (``library_open_loop``: ``OrchestratorClient`` in 8 threads). The
    service has the 1,024 ``FLEET`` workers registered. RTT: from the moment a
    submission is sent to its encode item arriving at a worker (HTTP in, journal
    commit, ZeroMQ out); the first tenth warms connections and caches and is not
    counted. ``probe``: ``wake_probe`` runs beside it, from the first submission to
    the last. Raises ``RuntimeError`` if any submission was not accepted."""
    import subprocess

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from servicestack import CLI, Proc, free_port

    api, wport = free_port(), free_port()
    argv = [*CLI, "orchestrator", "--port", str(api), "--worker-port", str(wport)]
    if journal:
        argv += ["--journal", os.path.join(tmp, f"bench-{time.time_ns()}.db")]
    if front_process:
        argv.append("--front-process")
    orch = Proc(argv)
    prober = (
        subprocess.Popen(
            [sys.executable, COMMAND, "--wake-probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if probe
        else None
    )
    out_path = os.path.join(tmp, f"arrived-{time.time_ns()}.json")
    agents = [
        subprocess.Popen(
            [sys.executable, COMMAND, "--fleet-agent", f"tcp://127.0.0.1:{wport}", out, stages],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for out, stages in ((out_path, "encode"), (os.devnull, "denoise,decode"))
    ]
    # this process's heap collected and set aside for the row: what the saturated and
    # chaos parts left (cycles included) took a collection of about 20 ms, which
    # fell inside the first row and held the client (send lag p99 6-19 ms, and the
    # burst it then sent queued at the service)
    gc.collect()
    gc.freeze()
    try:
        orch.wait_for("orchestrator ready")
        for ag in agents:
            assert ag.stdout is not None and ag.stdout.readline().strip() == "ready"
        if prober is not None:
            assert prober.stdin is not None and prober.stdout is not None
            assert prober.stdout.readline().strip() == "ready"
            prober.stdin.write("start\n")
            prober.stdin.flush()
        if client == "raw":
            sent, failures = raw_open_loop(api, rate, total)
        else:
            sent, failures = library_open_loop(f"http://127.0.0.1:{api}", rate, total)
        late: list[float] | None = None
        if prober is not None:
            late = sorted(json.loads(prober.communicate("stop\n", timeout=60)[0]))
        time.sleep(1.0)  # the last submissions reach their workers
        for ag in agents:
            assert ag.stdin is not None
            ag.stdin.write("stop\n")
            ag.stdin.flush()
        for ag in agents:
            ag.wait(60)
        with open(out_path) as f:
            arrived = json.load(f)
    finally:
        for ag in agents if prober is None else [*agents, prober]:
            if ag.poll() is None:
                ag.kill()
                ag.wait()
        orch.terminate()
        gc.unfreeze()
    if failures:
        raise RuntimeError(f"{len(failures)} submissions not accepted, first: {failures[0]}")
    warm = total // 10
    sent = {r: v for r, v in sent.items() if int(r.rsplit("-", 1)[1]) >= warm}
    rtts = sorted((arrived[r] - t) * 1e3 for r, (_, t) in sent.items() if r in arrived)
    lags = [(t - due) * 1e3 for due, t in sent.values()]
    span = max(t for _, t in sent.values()) - min(t for _, t in sent.values())
    q = statistics.quantiles(rtts, n=100)
    return ServiceRow(
        journal=journal,
        client=client,
        workers=sum(FLEET.values()),
        offered_per_s=rate or 0.0,
        achieved_per_s=(len(sent) - 1) / span,
        requests=len(sent),
        rtt_ms_p50=q[49],
        rtt_ms_p90=q[89],
        rtt_ms_p99=q[98],
        rtt_ms_max=max(rtts),
        send_lag_ms_p99=statistics.quantiles(lags, n=100)[98],
        dispatched=len(rtts),
        front="process" if front_process else "loop",
        # from the first submission to the last (the warm-up tenth's included)
        probe=probe,
        wake_late_ms_p99=statistics.quantiles(late, n=100)[98] if late and len(late) > 1 else None,
        wake_late_ms_max=late[-1] if late else None,
        wake_late_over_2ms=None if late is None else sum(x > 2.0 for x in late),
    )

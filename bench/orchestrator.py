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
import gc
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

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

POLICIES = ("round_robin", "least_loaded", "affinity")
# workers: encode, denoise, decode. "fleet": 1,344 workers; "xl": 4,096, the largest
# fleet the scheduler is meant to carry on one core.
POOLS = {
    "small": (4, 16, 4),
    "large": (16, 128, 32),
    "fleet": (64, 1024, 256),
    "xl": (256, 3072, 768),
}
CREDITS = {"encode": 4, "denoise": 1, "decode": 4}
#: a saturated run's ``order`` -> its part's name in the log, the tables and the JSON
PARTS = {"oldest": "saturated", "newest": "newest first"}
CHAOS_REQUESTS = 10_000
SERVICE_RATE = 1000.0  # submissions/s offered to the service, open loop
BEAT_SECONDS = 10.0  # each worker's heartbeat period in the saturated part
ITEM_SECONDS = 2.0  # virtual time an item holds its credit in the saturated part


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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


def worst_ratio(rows: list[SaturatedRow], pool: str, rate: str = "core_decisions_per_s") -> float:
    """Per policy, ``pool``'s ``rate`` over the smallest pool's (best run over best
    run, the rows of one ``saturated_all``); the worst policy's."""
    by = {(r.policy, r.pool): getattr(r, rate) for r in rows}
    smallest = next(iter(POOLS))
    return min(by[(p, pool)] / by[(p, smallest)] for p in POLICIES)


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
FLEET = {"encode": 64, "denoise": 768, "decode": 192}  # 1,024 registered workers


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


WAKE_PERIOD_S = 0.002  # the wake probe's sleep: 500 wake-ups/s, about 1 % of a CPU here


def wake_probe() -> int:
    """A child process: prints ``ready``; once a line comes on stdin, sleeps
    ``WAKE_PERIOD_S`` at a time (a ``select`` on stdin with that timeout) until the
    next line, then prints, as JSON, how late each wake-up came (ms). A process that
    needs almost no CPU is woken late only when the machine is not running it: other
    threads hold both CPUs past their turn, or the hypervisor took the virtual CPU
    away. A round trip through three processes cannot be steadier than that, so the
    diagnostic service row reports it beside its percentiles."""
    import select

    late: list[float] = []
    perf = time.perf_counter
    print("ready", flush=True)
    sys.stdin.readline()
    while True:
        t0 = perf()
        if select.select([sys.stdin], [], [], WAKE_PERIOD_S)[0]:
            sys.stdin.readline()
            break
        late.append((perf() - t0 - WAKE_PERIOD_S) * 1e3)
    print(json.dumps(late), flush=True)
    return 0


def fleet_agent(address: str, out_path: str, stages: str) -> int:
    """A child process: the ``FLEET`` workers of ``stages`` (comma-separated) on one
    thread, one DEALER socket each, that finish every item at once and note when each
    encode item arrived (``time.monotonic``, the same clock in every process). Prints
    ``ready`` once all are welcomed; on a line on stdin it writes the arrival times as
    JSON and exits. The encode workers get a process of their own, so the time
    measured is not that of polling a thousand sockets. Each worker beats once per
    interval at a phase of its own (worker i at i/n of it), as the workers of a fleet
    that joined at different times do, not all at once."""
    import select

    import zmq

    from mooncake_diffusion.orchestrator.link.wire import (
        Beat,
        Done,
        Hello,
        ItemRef,
        Welcome,
        Work,
        decode_from_service,
        encode,
    )

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * sum(FLEET.values()))  # the default is 1,023
    socks: list[tuple[zmq.Socket, str]] = []
    by_fd: dict[int, tuple[zmq.Socket, str]] = {}
    # epoll on each socket's ZMQ_FD, not zmq.Poller: a poll over a thousand sockets
    # costs a walk of all of them per wake-up, which took two thirds of a core here
    # from the service under test. ZMQ_FD only says "look again": each wake-up, and
    # each send, is followed by draining the socket while ZMQ_EVENTS says POLLIN.
    ep = select.epoll()
    for stage, n in FLEET.items():
        if stage not in stages.split(","):
            continue
        for i in range(n):
            wid = f"fleet-{stage}-{i}"
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, wid.encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            labels = {"node": f"n{i % 16}", "rail": str(i % 4)}
            s.send(encode(Hello(wid, stage, CREDITS[stage], labels)))
            socks.append((s, wid))
            fd = s.getsockopt(zmq.FD)
            by_fd[fd] = (s, wid)
            ep.register(fd, select.EPOLLIN)
    ep.register(sys.stdin.fileno(), select.EPOLLIN)
    arrived: dict[str, float] = {}
    welcomed = 0
    interval = 1.0

    def drain(s: zmq.Socket, wid: str) -> None:
        nonlocal welcomed, interval
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = decode_from_service(s.recv())
            if isinstance(msg, Work):
                it = msg.item
                if it.stage == "encode":
                    arrived.setdefault(it.request_id, time.monotonic())
                s.send(encode(Done(wid, ItemRef(it.request_id, it.stage, it.attempt), b"out")))
            elif isinstance(msg, Welcome):
                welcomed += 1
                interval = msg.heartbeat_interval
                if welcomed == len(socks):
                    print("ready", flush=True)

    for s, wid in socks:
        drain(s, wid)
    step = interval / len(socks)
    nxt, next_beat = 0, time.monotonic() + step
    while True:
        for fd, _ in ep.poll(max(0.0, next_beat - time.monotonic())):
            if fd == sys.stdin.fileno():
                sys.stdin.readline()
                with open(out_path, "w") as f:
                    json.dump(arrived, f)
                ep.close()
                for s, _ in socks:
                    s.close()
                ctx.term()
                return 0
            drain(*by_fd[fd])
        now = time.monotonic()
        while now >= next_beat:
            s, wid = socks[nxt]
            s.send(encode(Beat(wid)))
            drain(s, wid)  # a send can take the FD's signal of a frame that came in
            nxt = (nxt + 1) % len(socks)
            next_beat += step


def raw_open_loop(
    port: int, rate: float | None, total: int, conns: int = 16, limit_s: float = 60.0
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """The lean client: ``total`` ``POST /v1/requests`` at ``rate``/s (``None``: one at
    a time) from one thread over ``conns`` keep-alive HTTP/1.1 connections, each
    request pre-built and sent on a connection with no answer pending, stamped just
    before its send. Request ``i`` is due at ``t0 + i / rate`` whatever the answers
    (it waits only when every connection has an answer pending: that is its send
    lag). A connection the server closes while idle (its keep-alive timeout, 5 s by
    default: reused last-in first-out, a few connections carry 1,000/s and the rest
    sit idle) is replaced at once. Returns ``{request id: (due, sent)}`` and one line
    per answer that was not 201. Raises ``TimeoutError`` past ``limit_s`` and
    ``ConnectionError`` when the server closes a connection with an answer pending."""
    import selectors
    import socket

    sel = selectors.DefaultSelector()
    free: list[socket.socket] = []
    bufs: dict[socket.socket, bytes] = {}
    pending: dict[socket.socket, str] = {}

    def connect() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        free.insert(0, s)  # used last: the others are warm
        bufs[s] = b""

    for _ in range(conns if rate else 1):
        connect()
    head = (
        f"POST /v1/requests HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\n"
    ).encode()
    sent: dict[str, tuple[float, float]] = {}
    failures: list[str] = []

    def answers(s: socket.socket) -> None:
        buf = bufs[s]
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            lines = buf[:end].decode("latin-1").split("\r\n")
            length = next(
                (
                    int(v)
                    for k, _, v in (h.partition(":") for h in lines[1:])
                    if k.strip().lower() == "content-length"
                ),
                0,
            )
            if len(buf) < end + 4 + length:
                break
            rid = pending.pop(s)
            if lines[0].split()[1] != "201":
                failures.append(f"{rid}: {lines[0]} {buf[end + 4 : end + 4 + length][:200]!r}")
            buf = buf[end + 4 + length :]
            free.append(s)
        bufs[s] = buf

    i = 0
    closed_idle = 0
    t0 = time.monotonic() + 0.05
    stop = t0 + limit_s
    try:
        while i < total or pending:
            now = time.monotonic()
            if now > stop:
                raise TimeoutError(f"{len(pending)} answers not back within {limit_s:.0f} s")
            due = t0 + i / rate if rate else now
            if i < total and free and now >= due:
                s = free.pop()
                rid = f"open-{i}"
                body = b'{"params":{"i":%d},"request_id":"%s"}' % (i, rid.encode())
                msg = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
                t = time.monotonic()
                s.sendall(msg)
                sent[rid] = (due, t)
                pending[s] = rid
                i += 1
                continue
            wait = max(0.0, due - now) if i < total and free else 1.0
            for key, _ in sel.select(wait):
                s = key.fileobj  # type: ignore[assignment]
                data = s.recv(65536)
                if not data:
                    if s in pending:
                        raise ConnectionError("the orchestrator closed a connection")
                    sel.unregister(s)  # closed while idle: its keep-alive ran out
                    s.close()
                    free.remove(s)
                    del bufs[s]
                    connect()
                    closed_idle += 1
                    continue
                bufs[s] += data
                answers(s)
    finally:
        for s in bufs:
            s.close()
        sel.close()
    if closed_idle:
        log(f"the service closed {closed_idle} idle connections (keep-alive); replaced")
    return sent, failures


def library_open_loop(
    url: str, rate: float | None, total: int
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """The library client: ``OrchestratorClient.submit`` from 8 threads (one when
    ``rate`` is ``None``, each sent when the last was answered), request ``i`` due at
    ``t0 + i / rate``; the threads share one interpreter lock, so a send can wait
    for another thread's Python. Same return as ``raw_open_loop``."""
    import threading

    from mooncake_diffusion.orchestrator.http.client import OrchestratorClient

    sent: dict[str, tuple[float, float]] = {}
    failures: list[str] = []
    lock = threading.Lock()
    nxt = iter(range(total))
    t0 = time.monotonic() + 0.2

    def client_thread() -> None:
        with OrchestratorClient(url) as client:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                due = t0 + i / rate if rate else time.monotonic()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                rid = f"open-{i}"
                t = time.monotonic()
                try:
                    client.submit({"i": i}, request_id=rid)
                except Exception as e:  # reported with the row, not raised mid-run
                    failures.append(f"{rid}: {e!r}"[:300])
                sent[rid] = (due, t)

    threads = [threading.Thread(target=client_thread) for _ in range(8 if rate else 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent, failures


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
            [sys.executable, __file__, "--wake-probe"],
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
            [sys.executable, __file__, "--fleet-agent", f"tcp://127.0.0.1:{wport}", out, stages],
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # the whole docstring: what each part measures (the run's output points here)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer decisions and repeats, one chaos run (~50 s)"
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
    decisions, repeats = (10_000, 3) if a.quick else (40_000, 5)
    sat, ratios = saturated_all(decisions, repeats, a.seed)
    newest, newest_ratios = saturated_all(decisions, repeats, a.seed, "newest")
    ch = []
    for policy in ("affinity",) if a.quick else POLICIES:
        log(f"chaos: {CHAOS_REQUESTS} requests, {policy}")
        ch.append(chaos(policy, a.seed))
    svc = []
    with tempfile.TemporaryDirectory() as tmp:
        seconds = 3.0 if a.quick else 10.0
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
        svc.append(service_rtt(None, 300 if a.quick else 2000, True, tmp))
        log("service: the first row again, beside a probe of the machine's wake-ups")
        svc.append(service_rtt(SERVICE_RATE, n, True, tmp, probe=True))
    total = time.perf_counter() - t0
    print(markdown(sat + newest, ch, svc, {"oldest": ratios, "newest": newest_ratios}))
    print(f"\ntotal {total:.1f} s; dec/s = Dispatch actions per second (see --help)")
    print(f"load average at start {load_start}, at end {os.getloadavg()}")
    largest = list(POOLS)[-1]
    jsvc = next(
        r
        for r in svc
        if r.journal and r.offered_per_s and r.client == "raw" and r.front == "loop" and not r.probe
    )
    psvc = next(r for r in svc if r.probe)
    fsvc = next(r for r in svc if r.front == "process")
    lsvc = next(r for r in svc if r.client == "library")
    summary = {
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
    if a.json:
        doc = {
            "bench": "orchestrator",
            "machine": machine_info(),
            "config": {
                "quick": a.quick,
                "seed": a.seed,
                "decisions_per_run": decisions,
                "repeats": repeats,
            },
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
            "rows": [{"part": PARTS[r.order], **asdict(r)} for r in sat + newest]
            + [{"part": "chaos", **asdict(c)} for c in ch]
            + [{"part": "service", **asdict(r)} for r in svc],
            "summary": summary,
            # 1/5/15-minute load averages: how busy the machine was (its 2 CPUs are shared)
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "total_seconds": total,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    ok = summary["lost_requests"] == 0 and summary["duplicate_completions"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

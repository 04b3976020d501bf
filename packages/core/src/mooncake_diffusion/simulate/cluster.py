"""Colocated versus disaggregated serving on the real orchestrator core, in virtual time.

    result = simulate(MIXED, Layout("disaggregated", gpus=64, aux=2), Mechanisms(),
                      load=0.8, seed=0)
    summarize(result)        # goodput, throughput, P50/P99 TTFF, utilisation per pool

Each GPU is a serial executor; workers are registered with the real
``Orchestrator`` (a ``VirtualClock``, the core's queues, credits, priorities and
decode reservations decide every dispatch) and an item dispatched to a worker
runs on that worker's GPU for the service time of ``costs.RequestKind``.

Colocated: every GPU serves whole requests in FIFO order, Encode + Denoise +
Decode back to back (the VAE tiled where it does not fit beside the DiT). In
the core this is one denoise worker per GPU whose item costs the whole request
(Encode is skipped in the core and run inline; Decode passes through a
zero-cost bookkeeping worker), with both SLO classes at one priority.

Disaggregated: ``aux`` GPUs each host an encode and a decode worker (sharing
that GPU's time), the others one denoise worker each; 25 ms per stage boundary
for the transfer. Mechanisms, each a switch (``Mechanisms``):

- ``priorities``: interactive before batch in every queue, and step-boundary
  preemption: when an interactive job waits for denoise and every denoise
  worker is busy, a running batch job stops at its next step boundary (its
  step-checkpoint holds the progress) and goes back to the queue, resuming
  later from the steps it had done. This is the core's own rule
  (``OrchestratorConfig.preemption``): the core emits ``Preempt``, the
  simulated worker stops at its next step boundary and answers
  ``ItemYielded``, the core re-queues the job and gives the credit to the
  waiting interactive job (``max_preemptions`` is lifted here, as before the
  rule existed). Off: one FIFO class, no preemption.
- ``embedding_cache``: a cluster-wide cache holds the shared negative prompt
  (its share of encode time is saved) and a ``prompt_repeat`` share of
  positive prompts (the request skips Encode; ``Submit.cached_embeddings``).
- ``decode_off_dit``: decode runs on the aux GPUs, untiled. Off: each DiT GPU
  decodes its own latents, tiled where the kind says so, blocking its next job.
- ``no_offload``: on small-memory GPUs (``Layout.small_memory``) a GPU holding
  only the DiT or only the encoder keeps its weights resident. Off (and in
  colocated serving on such GPUs) the measured offloaded stage times apply.
- ``shared_decode``: one aux pool, sized for the whole cluster, serves every
  denoise worker. Off: every node of ``node_gpus`` GPUs has its own aux GPU(s)
  (``ceil(aux / nodes)`` each, at least one) and decodes only its own latents.

Assumptions not modelled (so no gain is claimed for them): larger denoise
batches from the memory freed by moving the VAE off the DiT GPUs (no public
measurement of batch scaling for these DiTs in workloads.md), network
contention, sequence parallelism (every denoise worker is one GPU), failures.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from mooncake_diffusion.orchestrator.clock import VirtualClock
from mooncake_diffusion.orchestrator.core import Orchestrator
from mooncake_diffusion.orchestrator.model import (
    Action,
    Dispatch,
    Event,
    ItemDone,
    ItemYielded,
    OrchestratorConfig,
    Preempt,
    RegisterWorker,
    Rejected,
    RequestCompleted,
    RequestFailed,
    SloClass,
    Submit,
    WorkItem,
)
from mooncake_diffusion.orchestrator.policy import WorkerView
from mooncake_diffusion.simulate.costs import TRANSFER_S, RequestKind
from mooncake_diffusion.simulate.events import EventQueue

__all__ = [
    "Layout",
    "Mechanisms",
    "RequestRecord",
    "RunResult",
    "Workload",
    "default_aux",
    "simulate",
]

Mode = Literal["colocated", "disaggregated"]
_NEVER = 1e15  # heartbeat timeout: simulated workers do not die


@dataclass(frozen=True)
class Mechanisms:
    """Which disaggregation mechanisms are on (see the module docstring)."""

    priorities: bool = True
    embedding_cache: bool = True
    decode_off_dit: bool = True
    no_offload: bool = True
    shared_decode: bool = True

    @classmethod
    def none(cls) -> Mechanisms:
        return cls(False, False, False, False, False)

    def without(self, name: str) -> Mechanisms:
        return replace(self, **{name: False})


@dataclass(frozen=True)
class Workload:
    """A request mix: ``(kind, share of arrivals)``. ``prompt_repeat``: the share of
    requests whose positive prompt embedding is already cached (an assumption:
    prompt reuse is reported by NIRVANA, workloads.md §9, without a rate)."""

    name: str
    kinds: tuple[tuple[RequestKind, float], ...]
    prompt_repeat: float = 0.2

    def mean_gpu_seconds(self) -> float:
        """Mean isolated GPU-seconds per request (what a load of 1.0 saturates)."""
        total = sum(s for _, s in self.kinds)
        return sum(k.isolated_s * s for k, s in self.kinds) / total

    def stage_seconds(self) -> tuple[float, float, float]:
        """Mean (encode, denoise, decode) seconds per request."""
        total = sum(s for _, s in self.kinds)
        e = sum(k.encode_s * s for k, s in self.kinds) / total
        d = sum(k.denoise_s * s for k, s in self.kinds) / total
        v = sum(k.decode_s * s for k, s in self.kinds) / total
        return e, d, v


@dataclass(frozen=True)
class Layout:
    """The cluster: ``gpus`` in all; for disaggregated serving ``aux`` of them host
    the encode and decode workers. ``node_gpus``: node size when decode pools are
    not shared. ``small_memory``: GPUs too small to hold encoder and DiT together."""

    mode: Mode
    gpus: int
    aux: int = 1
    node_gpus: int = 8
    small_memory: bool = False


def default_aux(workload: Workload, gpus: int, headroom: float = 3.0) -> int:
    """Aux GPUs sized by the stage-time ratio: ``headroom`` x the encode + decode share of
    the GPU time, at least 1 (pools sized by the stage-time ratio, issue 5 §4)."""
    e, d, v = workload.stage_seconds()
    return max(1, math.ceil(gpus * headroom * (e + v) / (e + d + v)))


@dataclass
class RequestRecord:
    """What happened to one request (times are virtual seconds)."""

    rid: str
    kind: RequestKind
    submitted: float
    deadline: float
    ttff: float | None = None
    done: float | None = None
    preemptions: int = 0
    encode_skipped: bool = False

    @property
    def met(self) -> bool:
        return self.done is not None and self.done <= self.deadline


@dataclass
class RunResult:
    records: list[RequestRecord]
    busy: dict[str, float]
    pool_gpus: dict[str, int]
    horizon: float
    window: tuple[float, float]
    makespan: float
    events: int
    rejected: int
    failed: int
    steps_run: int


class _Worker:
    __slots__ = ("cell", "gpu", "stage", "wid")

    def __init__(self, wid: str, stage: str, gpu: _Gpu | None, cell: _Cell) -> None:
        self.wid, self.stage, self.gpu, self.cell = wid, stage, gpu, cell


class _Run:
    """An item running on a GPU."""

    __slots__ = ("boundary0", "item", "start", "step_s", "steps_left", "token", "worker")

    def __init__(self, worker: _Worker, item: WorkItem, start: float, token: int) -> None:
        self.worker, self.item, self.start, self.token = worker, item, start, token
        self.boundary0 = 0.0
        self.steps_left = 0
        self.step_s = 0.0


class _Gpu:
    __slots__ = ("busy", "name", "node", "pool", "queue", "running")

    def __init__(self, name: str, pool: str, node: str) -> None:
        self.name, self.pool, self.node = name, pool, node
        self.queue: deque[tuple[_Worker, WorkItem]] = deque()
        self.running: _Run | None = None
        self.busy = 0.0


class _Route:
    """Routing: a decode item goes to a decode worker with the producing denoise worker's
    label ``key`` ("gpu": decode on the DiT's own GPU; "node": decode pools not shared
    across nodes) when one has a free credit; otherwise, and for every other item, to
    the least-loaded candidate (registration order breaks ties)."""

    def __init__(self, key: str | None) -> None:
        self.key = key

    def choose(self, item: WorkItem, candidates: Sequence[WorkerView]) -> WorkerView:
        want = item.hint.get(self.key) if self.key is not None else None
        if item.stage == "decode" and want is not None:
            for w in candidates:
                if w.labels.get(self.key) == want:  # type: ignore[arg-type]
                    return w
        return min(candidates, key=lambda w: (w.held / max(1, w.advertised), w.seq))


class _Cell:
    """One orchestrator core and the GPUs it schedules."""

    def __init__(self, name: str, core: Orchestrator) -> None:
        self.name = name
        self.core = core
        self.workers: dict[str, _Worker] = {}
        self.n_denoise = 0
        self.den_held = 0


@dataclass
class _Options:
    workload: Workload
    layout: Layout
    mech: Mechanisms
    seed: int
    rate: float | None
    horizon: float
    closed: tuple[int, int] | None  # (concurrency, total)
    warmup: float
    records: dict[str, RequestRecord] = field(default_factory=dict)


def _classes(priorities: bool) -> tuple[SloClass, ...]:
    batch_priority = 1 if priorities else 0
    return (
        SloClass("interactive", priority=0, deadline=1e9),
        SloClass("batch", priority=batch_priority, deadline=1e9),
    )


class _Sim:
    def __init__(self, o: _Options) -> None:
        self.o = o
        self.clock = VirtualClock()
        self.rng = random.Random(o.seed)
        self.queue = EventQueue(self.clock)
        self.token = 0
        self.events = 0
        self.rejected = 0
        self.failed = 0
        self.gpus: list[_Gpu] = []
        self.cells: list[_Cell] = []
        self.submitted = 0
        self.scheduled = 0  # closed loop: submits scheduled so far
        self.progress: dict[str, int] = {}  # denoise steps done before preemptions
        self.decoded: dict[str, int] = {}  # decode chunks done
        self.steps_run = 0  # denoise steps executed, preempted segments included
        self.kinds = [k for k, _ in o.workload.kinds]
        self.weights = [s for _, s in o.workload.kinds]
        self._build()

    # ------------------------------------------------------------ cluster
    def _core(self, priorities: bool, policy: object | None = None) -> Orchestrator:
        cfg = OrchestratorConfig(
            classes=_classes(priorities),
            heartbeat_timeout=_NEVER,
            preemption=priorities,  # only the disaggregated layouts ask for priorities
            max_preemptions=1_000_000,
        )
        return Orchestrator(cfg, clock=self.clock, policy=policy)  # type: ignore[arg-type]

    def _gpu(self, name: str, pool: str, node: int) -> _Gpu:
        g = _Gpu(name, pool, str(node))
        self.gpus.append(g)
        return g

    def _register(self, cell: _Cell, wid: str, stage: str, gpu: _Gpu | None, credits: int) -> None:
        labels = {"gpu": gpu.name, "node": gpu.node} if gpu is not None else {}
        w = _Worker(wid, stage, gpu, cell)
        cell.workers[wid] = w
        if stage == "denoise":
            cell.n_denoise += 1
        self._feed(cell, RegisterWorker(wid, stage, credits, labels, heartbeat_timeout=_NEVER))

    def _build(self) -> None:
        lay, mech = self.o.layout, self.o.mech
        if lay.mode == "colocated":
            cell = _Cell("all", self._core(False, _Route(None)))
            self.cells.append(cell)
            for i in range(lay.gpus):
                gpu = self._gpu(f"g{i}", "colocated", i // lay.node_gpus)
                self._register(cell, f"den-{i}", "denoise", gpu, 1)
            self._register(cell, "dec-virtual", "decode", None, lay.gpus + 1)
            return
        nodes = max(1, lay.gpus // lay.node_gpus)
        per_node = not mech.shared_decode and nodes > 1
        if per_node:  # every node hosts its own aux GPU(s); decode stays in the node
            aux_at = {
                n * lay.node_gpus + j
                for n in range(nodes)
                for j in range(max(1, math.ceil(lay.aux / nodes)))
            }
        else:
            aux_at = set(range(lay.aux))
        if not 1 <= len(aux_at) < lay.gpus:
            raise ValueError(f"aux GPUs must be in 1..{lay.gpus - 1}, got {len(aux_at)}")
        key = "gpu" if not mech.decode_off_dit else ("node" if per_node else None)
        cell = _Cell("all", self._core(mech.priorities, _Route(key)))
        self.cells.append(cell)
        dits = lay.gpus - len(aux_at)
        dits_per_aux = math.ceil(dits / len(aux_at))
        for i in range(lay.gpus):
            node = min(i // lay.node_gpus, nodes - 1)
            if i in aux_at:
                g = self._gpu(f"g{i}", "aux", node)
                self._register(cell, f"enc-{i}", "encode", g, 1)
                if mech.decode_off_dit:
                    # receive slots for latents: enough that decode reservations never
                    # throttle denoise admission more than the decode work itself does
                    self._register(cell, f"dec-{i}", "decode", g, dits_per_aux + 2)
            else:
                g = self._gpu(f"g{i}", "denoise", node)
                self._register(cell, f"den-{i}", "denoise", g, 1)
                if not mech.decode_off_dit:  # the latent being decoded + one waiting
                    self._register(cell, f"dec-{i}", "decode", g, 2)

    # ------------------------------------------------------------ events
    def _at(self, t: float, kind: str, arg: object) -> None:
        self.queue.at(t, kind, arg)

    def _feed(self, cell: _Cell, ev: Event) -> None:
        self.events += 1
        actions = cell.core.handle(ev)
        for a in actions:
            self._execute(cell, a)

    def _execute(self, cell: _Cell, a: Action) -> None:
        now = self.clock.now()
        if isinstance(a, Dispatch):
            w = cell.workers[a.worker_id]
            if a.item.stage == "denoise":
                cell.den_held += 1
            if w.gpu is None:  # the colocated bookkeeping decode: no GPU, no time
                self._at(now, "finish", (w, a.item, None))
                return
            w.gpu.queue.append((w, a.item))
            if w.gpu.running is None:
                self._start(w.gpu)
        elif isinstance(a, Preempt):
            self._preempt(cell.workers[a.worker_id], a)
        elif isinstance(a, RequestCompleted):
            rec = self.o.records[a.request_id]
            rec.done = now
            if self.o.closed is not None and self.scheduled < self.o.closed[1]:
                self.scheduled += 1
                self._at(now, "submit", None)
        elif isinstance(a, RequestFailed):
            self.failed += 1
        elif isinstance(a, Rejected):
            self.rejected += 1

    # ------------------------------------------------------------ service times
    def _offloaded(self) -> bool:
        lay = self.o.layout
        if not lay.small_memory:
            return False
        return lay.mode == "colocated" or not self.o.mech.no_offload

    def _encode_s(self, kind: RequestKind) -> float:
        t = kind.offload_encode_s if self._offloaded() and kind.offload_encode_s else kind.encode_s
        if self.o.layout.mode == "disaggregated" and self.o.mech.embedding_cache:
            t *= 1.0 - kind.negative_share
        return t

    def _step_s(self, kind: RequestKind) -> float:
        if self._offloaded() and kind.offload_step_s:
            return kind.offload_step_s
        return kind.step_s

    def _next(self, gpu: _Gpu) -> tuple[_Worker, WorkItem]:
        """The GPU's next item: FIFO, or with priorities the oldest interactive one first."""
        if self.o.layout.mode == "disaggregated" and self.o.mech.priorities:
            for i, (_, item) in enumerate(gpu.queue):
                if item.slo_class == "interactive":
                    if i == 0:
                        return gpu.queue.popleft()
                    entry = gpu.queue[i]
                    del gpu.queue[i]
                    return entry
        return gpu.queue.popleft()

    def _interactive_waits(self, gpu: _Gpu) -> bool:
        return any(item.slo_class == "interactive" for _, item in gpu.queue)

    def _start(self, gpu: _Gpu) -> None:
        now = self.clock.now()
        w, item = self._next(gpu)
        self.token += 1
        run = _Run(w, item, now, self.token)
        gpu.running = run
        rec = self.o.records[item.request_id]
        kind = rec.kind
        colocated = self.o.layout.mode == "colocated"
        if item.stage == "encode":
            took = self._encode_s(kind)
        elif item.stage == "denoise":
            pre = self._encode_s(kind) if colocated else TRANSFER_S
            run.steps_left = kind.steps - self.progress.get(item.request_id, 0)
            run.step_s = self._step_s(kind)
            run.boundary0 = now + pre
            took = pre + run.steps_left * run.step_s
            if colocated:
                dec = kind.decode_s * kind.decode_tile_factor
                rec.ttff = now + took + dec / kind.decode_chunks
                took += dec
        else:  # decode, one temporal chunk per segment (the causal VAE streams)
            on_dit = not self.o.mech.decode_off_dit
            done = self.decoded.get(item.request_id, 0)
            pre = 0.0 if on_dit or done else TRANSFER_S
            dec = kind.decode_s * (kind.decode_tile_factor if on_dit else 1.0)
            took = pre + dec / kind.decode_chunks
        self._at(now + took, "finish", (w, item, run.token))

    def _stop(self, gpu: _Gpu, end: float) -> None:
        run = gpu.running
        assert run is not None
        lo, hi = max(run.start, 0.0), min(end, self.o.horizon)
        if hi > lo:
            gpu.busy += hi - lo
        gpu.running = None

    # ------------------------------------------------------------ preemption
    def _preempt(self, w: _Worker, a: Preempt) -> None:
        """The core asked ``w`` to yield: stop at the job's next step boundary (a job
        that ends at that boundary just finishes; its ``ItemDone`` answers)."""
        run = w.gpu.running if w.gpu is not None else None
        if run is None or (run.item.request_id, run.item.attempt) != (a.request_id, a.attempt):
            return
        now = self.clock.now()
        k = max(0, math.ceil((now - run.boundary0) / run.step_s - 1e-9))
        if k < run.steps_left:
            self._at(max(run.boundary0 + k * run.step_s, now), "preempt", (run, k))

    def _ev_preempt(self, arg: object) -> None:
        run, k = arg  # type: ignore[misc]
        w = run.worker
        gpu, cell = w.gpu, w.cell
        if gpu.running is not run:
            return  # finished first
        rec = self.o.records[run.item.request_id]
        rec.preemptions += 1
        self.steps_run += k
        self.progress[rec.rid] = self.progress.get(rec.rid, 0) + k
        self._stop(gpu, self.clock.now())
        it = run.item
        cell.den_held -= 1
        self._feed(cell, ItemYielded(w.wid, it.request_id, "denoise", it.attempt))
        if gpu.running is None and gpu.queue:
            self._start(gpu)

    # ------------------------------------------------------------ handlers
    def _ev_finish(self, arg: object) -> None:
        w, item, token = arg  # type: ignore[misc]
        gpu = w.gpu
        if gpu is not None:
            if gpu.running is None or gpu.running.token != token:
                return  # preempted meanwhile
            self.steps_run += gpu.running.steps_left
            self._stop(gpu, self.clock.now())
        cell = w.cell
        if item.stage == "decode" and gpu is not None:
            rec = self.o.records[item.request_id]
            done = self.decoded[item.request_id] = self.decoded.get(item.request_id, 0) + 1
            if done == 1:
                rec.ttff = self.clock.now()  # the first chunk's frames are out
            if done < rec.kind.decode_chunks:
                # between chunks an interactive item on this GPU goes first (priorities)
                if self.o.mech.priorities and self._interactive_waits(gpu):
                    gpu.queue.append((w, item))
                else:
                    gpu.queue.appendleft((w, item))
                self._start(gpu)
                return
        if item.stage == "denoise":
            cell.den_held -= 1
        out = f"{item.stage}:{item.request_id}".encode()
        self._feed(cell, ItemDone(w.wid, item.request_id, item.stage, item.attempt, output=out))
        if gpu is not None and gpu.running is None and gpu.queue:
            self._start(gpu)

    def _ev_submit(self, _: object) -> None:
        now = self.clock.now()
        o = self.o
        kind = self.rng.choices(self.kinds, self.weights)[0]
        rid = f"r{self.submitted}"
        self.submitted += 1
        cell = self.cells[0]
        colocated = o.layout.mode == "colocated"
        repeat = self.rng.random() < o.workload.prompt_repeat
        skip = colocated or (o.mech.embedding_cache and repeat)
        rec = RequestRecord(rid, kind, now, now + kind.slo_s, encode_skipped=skip and not colocated)
        o.records[rid] = rec
        cached = b"emb:" + rid.encode() if skip else None
        ev = Submit(
            rid,
            kind.slo_class,
            params=rid.encode(),
            cached_embeddings=cached,
            deadline=rec.deadline,
        )
        self._feed(cell, ev)
        if o.rate is not None and o.closed is None:
            nxt = now + self.rng.expovariate(o.rate)
            if nxt < o.horizon:
                self._at(nxt, "submit", None)

    def run(self) -> RunResult:
        o = self.o
        if o.closed is not None:
            for _ in range(min(o.closed)):
                self.scheduled += 1
                self._at(0.0, "submit", None)
        else:
            assert o.rate is not None
            self._at(self.rng.expovariate(o.rate), "submit", None)
        handlers: dict[str, Callable[[object], None]] = {
            "submit": self._ev_submit,
            "finish": self._ev_finish,
            "preempt": self._ev_preempt,
        }
        self.queue.run(handlers)
        busy: dict[str, float] = {}
        pool_gpus: dict[str, int] = {}
        for g in self.gpus:
            busy[g.pool] = busy.get(g.pool, 0.0) + g.busy
            pool_gpus[g.pool] = pool_gpus.get(g.pool, 0) + 1
        recs = list(self.o.records.values())
        makespan = max((r.done or 0.0) for r in recs) if recs else 0.0
        horizon = self.o.horizon if self.o.closed is None else makespan
        return RunResult(
            recs,
            busy,
            pool_gpus,
            horizon,
            (self.o.warmup, horizon),
            makespan,
            self.events,
            self.rejected,
            self.failed,
            self.steps_run,
        )


def simulate(
    workload: Workload,
    layout: Layout,
    mech: Mechanisms | None = None,
    *,
    load: float | None = None,
    horizon: float = 10_000.0,
    warmup_share: float = 0.2,
    closed_loop: tuple[int, int] | None = None,
    seed: int = 0,
) -> RunResult:
    """One run. Open loop: Poisson arrivals for ``horizon`` virtual seconds at ``load``
    x the cluster's isolated capacity (``gpus / workload.mean_gpu_seconds()``), run
    until every request completed; metrics use arrivals after ``warmup_share`` of the
    horizon. Closed loop ``(concurrency, total)``: that many requests in flight
    until ``total`` were submitted (LightX2V's method, workloads.md §9)."""
    mech = mech if mech is not None else Mechanisms()
    rate = None
    if closed_loop is None:
        if load is None or not load > 0:
            raise ValueError("give load > 0 (open loop) or closed_loop")
        rate = load * layout.gpus / workload.mean_gpu_seconds()
    warmup = 0.0 if closed_loop is not None else warmup_share * horizon
    opts = _Options(workload, layout, mech, seed, rate, horizon, closed_loop, warmup)
    return _Sim(opts).run()

"""Colocated versus disaggregated serving on the real orchestrator core, in virtual time.

    result = simulate(MIXED, Layout("disaggregated", gpus=64, aux=2), Mechanisms(),
                      load=0.8, seed=0)
    summarize(result)        # goodput, throughput, P50/P99 TTFF, utilisation per pool
    result.config            # the OrchestratorConfig both layouts ran under

Each GPU is a serial executor; workers are registered with the real
``Orchestrator`` (a ``VirtualClock``, the core's queues, credits, priorities,
step-boundary preemption and decode reservations decide every dispatch) and an
item dispatched to a worker runs on that worker's GPU for the service time of
``costs.RequestKind``.

**One scheduler for both layouts.** ``Scheduler`` (priorities, step-boundary
preemption, ``max_preemptions``: the shipped defaults unless changed, and then
for both sides) builds the one ``OrchestratorConfig`` that every layout runs
under; only the routing policy's worker labels differ, because the layouts'
workers differ.

Colocated: every GPU serves whole requests, Encode + Denoise + Decode back to
back. In the core this is one denoise worker per GPU whose item costs the whole
request (Encode runs inline, so the core skips it; Decode passes through a
zero-cost bookkeeping worker). It yields at step boundaries like a denoise
worker (its checkpoint holds the embeddings and latents; resuming reloads it for
one transfer time). What a GPU holding all three stages pays when they do not
fit its memory comes from ``costs.placement_penalty``.

Disaggregated: ``aux`` GPUs (of type ``Layout.aux_gpu``) each host an encode and
a decode worker (sharing that GPU's time), the others one denoise worker each;
25 ms per stage boundary for the transfer. What only disaggregation changes,
each a switch (``Mechanisms``):

- ``fit_memory``: each GPU holds only its own stages' weights, so what did not
  fit beside the DiT (the encoder, the untiled decode peak) now fits. Off: the
  disaggregated GPUs pay the colocated placement penalties.
- ``decode_off_dit``: decode runs on the aux GPUs, and the DiT GPU starts its
  next job while the previous request decodes. Off: each DiT GPU decodes its
  own latents, blocking its next job.
- ``shared_decode``: one aux pool, sized for the whole cluster, serves every
  denoise worker. Off: every node of ``node_gpus`` GPUs has its own aux GPU(s)
  (``ceil(aux / nodes)`` each, at least one) and decodes only its own latents.
- ``cross_instance_cache``: a repeated prompt's embedding is found in the
  cluster-wide cache whichever instance encoded it (``Workload.prompt_repeat``).
  Off, and for colocated serving by default: a repeat hits only if the same
  instance served it before (one in ``instances``). Colocated instances could
  share the cache through Mooncake Store too, so the ablation turns it on there.
  The shared negative prompt is cached per instance on both sides.

Flex (``Layout("flex", n)``): every GPU hosts an encode, a denoise and a decode
worker (the fractional host of every GPU). A request's Encode runs inline on the
GPU the core places its Denoise on (one item, as colocated: the core's queue and
preemption order whole requests), its Decode is an item of its own that the core
places, on the same GPU when that worker has a free credit (then the GPU with
the fewest items, then least loaded); a Decode landing on a GPU that runs a
denoise job runs at that job's next step boundary. Elastic
(``Layout("elastic", n, aux=k, planner=NAME)``): the static split, resized during
the run by a registry planner (``elastic.py``).

Memory (``simulate(memory=...)``): ``"resident"`` (issue 29's runs) assumes every
GPU holds every model of its mix; ``"swap"`` (``memory.py``; flex and elastic
always) loads a model a GPU does not hold at ``costs.LOAD_GBPS`` before the item
that needs it, evicting the least recently used, on every layout alike; routing
then prefers the GPUs that load least.

Heterogeneous pools are a layout, not a switch: ``Layout.aux_gpu`` puts Encode
and Decode on a cheaper GPU type, slower by the bandwidth ratio; compare cost
with ``Layout.price_per_hour``. A mix that shifts during the run
(``Workload.later``) tests pools sized for the first mix.

Assumptions not modelled (so no gain is claimed for them): larger denoise
batches from the memory freed by moving the VAE off the DiT GPUs (no public
measurement of batch scaling for these DiTs in docs/sources.md), network
contention, sequence parallelism (every denoise worker is one GPU), failures.

This module holds ``simulate()`` and ``_Sim``, the event-driven run: it builds the
cluster, feeds the core its events and plays the core's actions on the GPUs.
``model.py`` holds what a run takes and returns; ``gpus.py`` the GPUs, the routing
policy and what an item costs on a GPU (``_ItemCosts``, ``_Sim``'s base class).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

from mooncake_diffusion.orchestrator.core.clock import VirtualClock
from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import (
    Action,
    Dispatch,
    Event,
    ItemDone,
    ItemYielded,
    Preempt,
    RegisterWorker,
    Rejected,
    RequestCompleted,
    RequestFailed,
    Submit,
    WorkItem,
)
from mooncake_diffusion.simulate.arrivals import Arrivals, Poisson
from mooncake_diffusion.simulate.costs import TRANSFER_S, Placement
from mooncake_diffusion.simulate.elastic import Elastic
from mooncake_diffusion.simulate.events import EventQueue
from mooncake_diffusion.simulate.gpus import _Cell, _Gpu, _ItemCosts, _Route, _Run, _Worker
from mooncake_diffusion.simulate.memory import Model
from mooncake_diffusion.simulate.model import (
    _NEVER,
    Layout,
    Mechanisms,
    Memory,
    RequestRecord,
    RunResult,
    Scheduler,
    Workload,
    _Options,
)

__all__ = ["simulate"]

_STAGE_ORDER = ("encode", "denoise", "decode")


class _Sim(_ItemCosts):
    def __init__(self, o: _Options) -> None:
        self.o = o
        self.clock = VirtualClock()
        self.rng = random.Random(o.seed)
        # cache draws on their own stream: switching the cache leaves arrivals unchanged
        self.cache_rng = random.Random(f"cache-{o.seed}")
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
        self.paused: set[str] = set()  # denoise jobs paused on a host GPU, to resume there
        self.kinds = [k for k, _ in o.workload.kinds]
        self.weights = [s for _, s in o.workload.kinds]
        self.config = o.sched.config()
        self.aux_count = 0
        self.seen: dict[int, int] = {}  # prompt id -> the instance that encoded it
        self._placements: dict[tuple[str, str], Placement] = {}
        self.unfit: set[str] = set()
        self._gaps = o.arrivals.gaps(self.rng, o.rate) if o.rate is not None else None
        self.swap = o.memory == "swap"
        #: colocated and flex: a request's Encode runs inline on the GPU that runs its
        #: Denoise (the core places the two as one item; flex's Decode is its own item)
        self.inline_encode = o.layout.mode in ("colocated", "flex")
        self.gpu_of: dict[str, _Gpu] = {}
        self.completed = 0
        self.stage_changes: list[tuple[float, str, tuple[str, ...], tuple[str, ...]]] = []
        self.elastic: Elastic | None = None
        self._model_memo: dict[tuple[str, str, str, bool], list[Model]] = {}
        self._build()
        if self.swap:
            self._fill_caches()
        if o.layout.mode == "elastic":
            assert o.layout.planner is not None
            self.elastic = Elastic(self, o.layout.planner)

    # ------------------------------------------------------------ cluster
    def _core(self, policy: _Route) -> Orchestrator:
        """The core, with the one configuration every layout uses."""
        if self.swap:
            policy.prefer = self._prefer
        return Orchestrator(self.config, clock=self.clock, policy=policy)  # type: ignore[arg-type]

    def _gpu(self, name: str, pool: str, node: int) -> _Gpu:
        g = _Gpu(name, pool, str(node))
        self.gpus.append(g)
        self.gpu_of[name] = g
        return g

    def _register(self, cell: _Cell, wid: str, stage: str, gpu: _Gpu | None, credits: int) -> None:
        labels = {"gpu": gpu.name, "node": gpu.node} if gpu is not None else {}
        w = _Worker(wid, stage, gpu, cell)
        cell.workers[wid] = w
        if gpu is not None:
            gpu.wids.append(wid)
            gpu.stages = tuple(sorted({*gpu.stages, stage}, key=_STAGE_ORDER.index))
        if stage == "denoise":
            cell.n_denoise += 1
        self._feed(cell, RegisterWorker(wid, stage, credits, labels, heartbeat_timeout=_NEVER))

    def _build(self) -> None:
        lay, mech = self.o.layout, self.o.mech
        if lay.mode == "flex":  # every GPU holds every stage: E and V yield at step boundaries
            self._build_fractional(replace(lay, mode="disaggregated", aux=0, hosts=lay.gpus), mech)
            route = self.cells[0].core.policy
            assert isinstance(route, _Route)
            route.key, route.sticky = "gpu", True  # a request stays on one GPU when it can
            route.gpu_load = self._gpu_load
            return
        if lay.mode == "elastic":  # starts as its static split; Elastic moves GPUs
            lay = replace(lay, mode="disaggregated", planner=None)
        if lay.mode == "colocated":
            cell = _Cell("all", self._core(_Route(None)))
            self.cells.append(cell)
            for i in range(lay.gpus):
                gpu = self._gpu(f"g{i}", "colocated", i // lay.node_gpus)
                self._register(cell, f"den-{i}", "denoise", gpu, 1)
            self._register(cell, "dec-virtual", "decode", None, lay.gpus + 1)
            return
        nodes = max(1, lay.gpus // lay.node_gpus)
        per_node = not mech.shared_decode and nodes > 1
        if lay.aux == 0:
            self._build_fractional(lay, mech)
            return
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
        cell = _Cell("all", self._core(_Route(key)))
        self.aux_count = len(aux_at)
        self.cells.append(cell)
        dits = lay.gpus - len(aux_at)
        split = lay.split_aux and len(aux_at) >= 2 and mech.decode_off_dit
        decoders = len(aux_at) // 2 if split else len(aux_at)
        dits_per_aux = math.ceil(dits / decoders)
        for i in range(lay.gpus):
            node = min(i // lay.node_gpus, nodes - 1)
            if i in aux_at:
                g = self._gpu(f"g{i}", "aux", node)
                if split and sorted(aux_at).index(i) % 2:  # E and V on alternate aux GPUs
                    self._register(cell, f"dec-{i}", "decode", g, dits_per_aux + 2)
                    continue
                self._register(cell, f"enc-{i}", "encode", g, 1)
                if mech.decode_off_dit and not split:
                    # receive slots for latents: enough that decode reservations never
                    # throttle denoise admission more than the decode work itself does
                    self._register(cell, f"dec-{i}", "decode", g, dits_per_aux + 2)
            else:
                g = self._gpu(f"g{i}", "denoise", node)
                self._register(cell, f"den-{i}", "denoise", g, 1)
                if not mech.decode_off_dit:  # the latent being decoded + one waiting
                    self._register(cell, f"dec-{i}", "decode", g, 2)

    def _build_fractional(self, lay: Layout, mech: Mechanisms) -> None:
        """``aux=0``: ``hosts`` denoise GPUs also run an encode and a decode worker."""
        if not 1 <= lay.hosts <= lay.gpus:
            raise ValueError(f"hosts must be in 1..{lay.gpus}, got {lay.hosts}")
        key = "gpu" if not mech.decode_off_dit else None
        cell = _Cell("all", self._core(_Route(key)))
        self.cells.append(cell)
        dits_per_host = math.ceil(lay.gpus / lay.hosts)
        for i in range(lay.gpus):
            node = i // lay.node_gpus
            host = i >= lay.gpus - lay.hosts  # last: ties in routing go elsewhere first
            g = self._gpu(f"g{i}", "host" if host else "denoise", node)
            self._register(cell, f"den-{i}", "denoise", g, 1)
            if host:
                self._register(cell, f"enc-{i}", "encode", g, 1)
            if host and mech.decode_off_dit:
                self._register(cell, f"dec-{i}", "decode", g, dits_per_host + 2)
            elif not mech.decode_off_dit:
                self._register(cell, f"dec-{i}", "decode", g, 2)

    # ------------------------------------------------------------ events
    def _at(self, t: float, kind: str, arg: object) -> None:
        self.queue.at(t, kind, arg)

    def _feed(self, cell: _Cell, ev: Event) -> None:
        self.events += 1
        actions = cell.core.handle(ev)
        if self.elastic is not None:
            self.elastic.window.observe(self.clock.now(), ev, actions)
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
            elif w.gpu.pool == "host":
                self._pause_soon(w.gpu)
        elif isinstance(a, Preempt):
            self._preempt(cell.workers[a.worker_id], a)
        elif isinstance(a, RequestCompleted):
            self.completed += 1
            rec = self.o.records[a.request_id]
            rec.done = now
            if self.o.closed is not None and self.scheduled < self.o.closed[1]:
                self.scheduled += 1
                self._at(now, "submit", None)
        elif isinstance(a, RequestFailed):
            self.completed += 1
            self.failed += 1
        elif isinstance(a, Rejected):
            self.rejected += 1

    # ------------------------------------------------------------ running items
    def _next(self, gpu: _Gpu) -> tuple[_Worker, WorkItem]:
        """The GPU's next item: FIFO, or with priorities the oldest interactive one first."""
        if self.o.sched.priorities:
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
            took = self._load_s(gpu, kind, "encode") + self._encode_s(kind, gpu)
        elif item.stage == "denoise":
            done_steps = self.progress.get(item.request_id, 0)
            paused = item.request_id in self.paused
            fresh = self.inline_encode and not done_steps and not paused
            load = self._load_s(gpu, kind, "denoise", fresh and not rec.encode_skipped)
            if paused:  # resumes where it paused, on this GPU
                self.paused.discard(item.request_id)
                pre = 0.0
            elif fresh:  # encode inline (unless the cache held it)
                pre = 0.0 if rec.encode_skipped else self._encode_s(kind, gpu)
            else:  # the embeddings (or a checkpoint) arrive over one transfer
                pre = TRANSFER_S
            pre += load
            run.steps_left = kind.steps - done_steps
            run.step_s = self._step_s(kind, gpu)
            run.boundary0 = now + pre
            took = pre + run.steps_left * run.step_s
            if colocated:
                dec = self._decode_s(kind, True, gpu)
                rec.ttff = now + took + dec / kind.decode_chunks
                took += dec
        else:  # decode, one temporal chunk per segment (the causal VAE streams)
            on_dit = not self.o.mech.decode_off_dit
            done = self.decoded.get(item.request_id, 0)
            pre = 0.0 if on_dit or done else TRANSFER_S
            took = pre + self._decode_s(kind, on_dit, gpu) / kind.decode_chunks
        self._at(now + took, "finish", (w, item, run.token))
        if gpu.pool == "host" and item.stage == "denoise":
            self._pause_soon(gpu)

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
        if self.elastic is not None:
            self.elastic.idle(gpu)

    def _pause_soon(self, gpu: _Gpu) -> None:
        """A fractional host GPU runs an Encode or Decode item that arrived during a
        denoise job at that job's next step boundary (the job resumes after it)."""
        run = gpu.running
        if run is None or run.item.stage != "denoise" or run.pausing:
            return
        ahead = ("interactive",) if run.item.slo_class == "interactive" else None
        if not any(
            it.stage != "denoise"
            and (ahead is None or it.slo_class in ahead or not self.o.sched.priorities)
            for _, it in gpu.queue
        ):
            return  # nothing queued that would run before the job resumes
        now = self.clock.now()
        k = max(0, math.ceil((now - run.boundary0) / run.step_s - 1e-9))
        if k < run.steps_left:
            run.pausing = True
            self._at(max(run.boundary0 + k * run.step_s, now), "pause", (run, k))

    def _ev_pause(self, arg: object) -> None:
        run, k = arg  # type: ignore[misc]
        gpu = run.worker.gpu
        if gpu.running is not run:
            return  # finished or preempted first
        rid = run.item.request_id
        self.steps_run += k
        self.progress[rid] = self.progress.get(rid, 0) + k
        self._stop(gpu, self.clock.now())
        self.paused.add(rid)
        gpu.queue.append((run.worker, run.item))  # behind the Encode / Decode items
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
                if self.o.sched.priorities and self._interactive_waits(gpu):
                    gpu.queue.append((w, item))
                else:
                    gpu.queue.appendleft((w, item))
                self._start(gpu)
                return
        if item.stage == "denoise":
            cell.den_held -= 1
            rec = self.o.records[item.request_id]
            if rec.ttff is not None and rec.ttff > self.clock.now():
                rec.ttff = self.clock.now()  # colocated, one chunk: the same instant (rounding)
        out = f"{item.stage}:{item.request_id}".encode()
        self._feed(cell, ItemDone(w.wid, item.request_id, item.stage, item.attempt, output=out))
        if gpu is not None and gpu.running is None and gpu.queue:
            self._start(gpu)
        if gpu is not None and self.elastic is not None:
            self.elastic.idle(gpu)

    def _ev_submit(self, _: object) -> None:
        now = self.clock.now()
        o = self.o
        w = o.workload
        mix = w.kinds if w.later is None or now < w.shift_at * o.horizon else w.later
        if mix is w.kinds:
            kind = self.rng.choices(self.kinds, self.weights)[0]
        else:
            kind = self.rng.choices([k for k, _ in mix], [x for _, x in mix])[0]
        rid = f"r{self.submitted}"
        self.submitted += 1
        cell = self.cells[0]
        colocated = o.layout.mode == "colocated"
        hit = self._cache_hit(colocated)
        rec = RequestRecord(rid, kind, now, now + kind.slo_s, encode_skipped=hit)
        o.records[rid] = rec
        skip = self.inline_encode or hit  # the GPU encodes inline, never the core
        cached = b"emb:" + rid.encode() if skip else None
        ev = Submit(
            rid,
            kind.slo_class,
            params=rid.encode(),
            cached_embeddings=cached,
            deadline=rec.deadline,
        )
        self._feed(cell, ev)
        if self._gaps is not None and o.closed is None:
            nxt = now + next(self._gaps)
            if nxt < o.horizon:
                self._at(nxt, "submit", None)

    def _cache_hit(self, colocated: bool) -> bool:
        """Whether this request's positive-prompt embedding is cached: a repeat (share
        ``prompt_repeat``) always hits a cross-instance cache; an instance-local cache
        hits only when the earlier request landed on the same instance."""
        if self.cache_rng.random() >= self.o.workload.prompt_repeat:
            return False
        if self.o.mech.cross_instance_cache:
            return True
        lay = self.o.layout
        instances = lay.gpus if colocated else max(1, self.aux_count)
        return self.cache_rng.random() < 1.0 / instances

    def run(self) -> RunResult:
        o = self.o
        if o.closed is not None:
            for _ in range(min(o.closed)):
                self.scheduled += 1
                self._at(0.0, "submit", None)
        else:
            assert self._gaps is not None
            self._at(next(self._gaps), "submit", None)
        handlers: dict[str, Callable[[object], None]] = {
            "submit": self._ev_submit,
            "finish": self._ev_finish,
            "preempt": self._ev_preempt,
            "pause": self._ev_pause,
        }
        if self.elastic is not None:
            handlers["plan"] = lambda _: self.elastic.plan()  # type: ignore[union-attr]
            handlers["loaded"] = self.elastic.loaded  # type: ignore[dict-item]
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
            self.config,
            self.o.layout.price_per_hour(self.aux_count or None),
            sorted(self.unfit),
            self.o.memory,
            sum(g.cache.loaded_gb for g in self.gpus if g.cache is not None),
            list(self.stage_changes),
            self._planner_report(),
        )

    def _planner_report(self) -> dict[str, object] | None:
        e = self.elastic
        if e is None:
            return None
        return {
            "name": e.name,
            "options": dict(e.options),
            "decisions": e.decisions,
            "ignored": e.ignored,
            "stage_changes": len(self.stage_changes),
            "load_gpu_s": e.load_s,
        }


def simulate(
    workload: Workload,
    layout: Layout,
    mech: Mechanisms | None = None,
    *,
    sched: Scheduler | None = None,
    load: float | None = None,
    rate: float | None = None,
    horizon: float = 10_000.0,
    warmup_share: float = 0.2,
    warmup: float | None = None,
    closed_loop: tuple[int, int] | None = None,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    memory: Memory | None = None,
) -> RunResult:
    """One run. Open loop: Poisson arrivals for ``horizon`` virtual seconds at ``load``
    x the cluster's isolated capacity (``gpus / workload.mean_gpu_seconds()``), run
    until every request completed; metrics use arrivals after ``warmup_share`` of the
    horizon (or after ``warmup`` seconds). ``rate`` (requests/s) instead of ``load``
    sets the mean arrival rate directly; ``arrivals`` the process (Poisson default).
    Closed loop ``(concurrency, total)``: that many requests in flight until
    ``total`` were submitted (LightX2V's method, docs/sources.md).

    ``mech`` defaults to every mechanism on for disaggregated, flex and elastic
    serving and to ``Mechanisms.none()`` for colocated; ``sched`` (the same for
    every layout) to the shipped scheduler. ``memory``: ``"resident"`` (every GPU
    holds every model of its mix) or ``"swap"`` (``memory.py``: models load on
    demand at the cited bandwidth, the same rule for every layout); default
    ``"swap"`` for flex and elastic, ``"resident"`` otherwise."""
    if mech is None:
        mech = Mechanisms() if layout.mode != "colocated" else Mechanisms.none()
    if memory is None:
        memory = "swap" if layout.mode in ("flex", "elastic") else "resident"
    sched = sched if sched is not None else Scheduler()
    if closed_loop is None and rate is None:
        if load is None or not load > 0:
            raise ValueError("give load > 0 (open loop) or closed_loop")
        rate = load * layout.gpus / workload.mean_gpu_seconds()
    if closed_loop is None and not (rate is not None and rate > 0):
        raise ValueError("give load > 0 or rate > 0 (open loop) or closed_loop")
    if closed_loop is not None:
        rate, warm = None, 0.0
    else:
        warm = warmup if warmup is not None else warmup_share * horizon
    proc = arrivals if arrivals is not None else Poisson()
    opts = _Options(
        workload, layout, mech, sched, seed, rate, horizon, closed_loop, warm, proc, memory
    )
    return _Sim(opts).run()

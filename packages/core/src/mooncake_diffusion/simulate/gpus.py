"""The simulated GPUs: workers, queues, running items, routing, and what an item costs.

    _Gpu        a serial executor: its queue, the item running, busy time, the models
                it holds (``memory="swap"``), its stages (elastic moves change them)
    _Worker     a core worker on a GPU (None: the colocated bookkeeping decode)
    _Run        the item a GPU runs, with its step boundaries (preemption, pausing)
    _Route      the routing policy the core calls (``choose``) for every dispatch
    _Cell       one orchestrator core and its workers
    _ItemCosts  the base of ``cluster._Sim``: the placement a GPU pays for a kind,
                the stage times that follow, the models an item needs and the time
                to load them (``memory="swap"``), and the routing preference for
                the GPUs that load least

Nothing here advances time: ``cluster._Sim`` owns the clock and the events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.core.routing import WorkerView
from mooncake_diffusion.simulate.costs import (
    LOAD_GBPS,
    TILE_MEMORY_DIVISOR,
    Placement,
    RequestKind,
    placement_penalty,
)
from mooncake_diffusion.simulate.memory import Model, ModelCache
from mooncake_diffusion.simulate.model import _Options

__all__: list[str] = []


class _Worker:
    __slots__ = ("cell", "gpu", "stage", "wid")

    def __init__(self, wid: str, stage: str, gpu: _Gpu | None, cell: _Cell) -> None:
        self.wid, self.stage, self.gpu, self.cell = wid, stage, gpu, cell


class _Run:
    """An item running on a GPU."""

    __slots__ = (
        "boundary0",
        "item",
        "pausing",
        "start",
        "step_s",
        "steps_left",
        "token",
        "worker",
    )

    def __init__(self, worker: _Worker, item: WorkItem, start: float, token: int) -> None:
        self.worker, self.item, self.start, self.token = worker, item, start, token
        self.boundary0 = 0.0
        self.pausing = False
        self.steps_left = 0
        self.step_s = 0.0


class _Gpu:
    __slots__ = (
        "busy",
        "cache",
        "changes",
        "name",
        "node",
        "pool",
        "queue",
        "running",
        "stages",
        "state",
        "target",
        "wids",
    )

    def __init__(self, name: str, pool: str, node: str) -> None:
        self.name, self.pool, self.node = name, pool, node
        self.queue: deque[tuple[_Worker, WorkItem]] = deque()
        self.running: _Run | None = None
        self.busy = 0.0
        self.cache: ModelCache | None = None  # memory="swap": the models it holds
        self.stages: tuple[str, ...] = ()  # stages its workers serve
        self.state = "serving"  # elastic: "changing" (emptying), "loading"
        self.target: tuple[str, ...] = ()  # elastic: the stages it changes to
        self.wids: list[str] = []  # its live workers' ids
        self.changes = 0


class _Route:
    """Routing: a decode item goes to a decode worker with the producing denoise worker's
    label ``key`` ("gpu": decode on the DiT's own GPU; "node": decode pools not shared
    across nodes) when one has a free credit; otherwise, and for every other item, to
    the least-loaded candidate (registration order breaks ties)."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        #: memory="swap": keeps the candidates whose GPU loads least for the item
        self.prefer: Callable[[WorkItem, Sequence[WorkerView]], Sequence[WorkerView]] | None
        self.prefer = None
        self.sticky = False  # flex: every stage stays on its input's GPU when it can
        #: flex: items on a worker's GPU (all its stages: credits shared, as a
        #: multi-stage worker's are), the first key of least-loaded
        self.gpu_load: Callable[[WorkerView], int] | None = None

    def choose(self, item: WorkItem, candidates: Sequence[WorkerView]) -> WorkerView:
        want = item.hint.get(self.key) if self.key is not None else None
        if want is not None and (item.stage == "decode" or self.sticky):
            for w in candidates:
                if w.labels.get(self.key) == want:  # type: ignore[arg-type]
                    return w
        if self.prefer is not None:  # memory="swap": the GPUs that load least first
            candidates = self.prefer(item, candidates)
        if self.gpu_load is not None:
            load = self.gpu_load
            return min(candidates, key=lambda w: (load(w), w.held / max(1, w.advertised), w.seq))
        return min(candidates, key=lambda w: (w.held / max(1, w.advertised), w.seq))


class _Cell:
    """One orchestrator core and the GPUs it schedules."""

    def __init__(self, name: str, core: Orchestrator) -> None:
        self.name = name
        self.core = core
        self.workers: dict[str, _Worker] = {}
        self.n_denoise = 0
        self.den_held = 0


class _ItemCosts:
    """What an item costs on a GPU: its placement penalty, stage times and model loads.

    A base class: ``cluster._Sim`` sets the attributes annotated here in its
    ``__init__`` (these methods only read them, and fill the two memos and
    ``unfit``). Every method is pure bookkeeping, called from the event handlers
    and from routing (``_prefer``, ``_gpu_load``); none advances time."""

    o: _Options
    gpus: list[_Gpu]
    gpu_of: dict[str, _Gpu]
    paused: set[str]  # denoise jobs paused on a host GPU, to resume there
    unfit: set[str]  # kind@role placements with no measured offload time
    _placements: dict[tuple[str, str], Placement]
    _model_memo: dict[tuple[str, str, str, bool], list[Model]]

    # ------------------------------------------------------------ memory="swap"
    def _all_kinds(self) -> list[RequestKind]:
        w = self.o.workload
        return list({k.name: k for k, _ in w.kinds + (w.later or ())}.values())

    def _budget(self, gpu: _Gpu) -> float:
        """Weights a GPU may hold: usable memory less the decode peak it keeps free."""
        gtype = self.o.layout.aux_type if gpu.pool == "aux" else self.o.layout.gpu
        decodes = gpu.pool in ("colocated", "host") or "decode" in gpu.stages
        reserve = 0.0
        if decodes:
            role = self._role(gpu, "aux")
            for k in self._all_kinds():
                tile = self._placement(k, role).tile
                reserve = max(reserve, k.vae_peak_gb / (TILE_MEMORY_DIVISOR if tile else 1.0))
        return gtype.usable_gb - reserve

    def _models(self, kind: RequestKind, stage: str, gpu: _Gpu, encode: bool = True) -> list[Model]:
        """The models an item of ``stage`` needs on ``gpu`` (none for a kind whose
        placement there offloads weights: its measured times price that); memoised
        per kind, stage, pool and whether it encodes."""
        key = (kind.name, stage, gpu.pool, encode)
        got = self._model_memo.get(key)
        if got is None:
            got = self._model_memo[key] = self._models_of(kind, stage, gpu, encode)
        return got

    def _models_of(self, kind: RequestKind, stage: str, gpu: _Gpu, encode: bool) -> list[Model]:
        # colocated, and flex's denoise item: the GPU encodes inline before the steps
        colocated = gpu.pool == "colocated" or self.o.layout.mode == "flex"
        role = self._role(gpu, "aux" if stage == "encode" else "denoise")
        if self._placement(kind, role).offload:
            return []
        out: list[Model] = []
        if stage == "encode" or (colocated and stage == "denoise" and encode):
            out.append((("encoder", kind.name), kind.encoder_gb))
        if stage == "denoise":
            out.append((("dit", kind.name), kind.dit_gb))
        return out

    def _gpu_models(self, gpu: _Gpu, kinds: Sequence[RequestKind]) -> list[Model]:
        """Every model ``gpu``'s stages need for ``kinds``, in that order."""
        stages = ("denoise",) if gpu.pool == "colocated" else gpu.stages
        out: list[Model] = []
        for k in kinds:
            for st in stages:
                out.extend(m for m in self._models(k, st, gpu) if m not in out)
        return out

    def _fill_caches(self) -> None:
        """Each GPU starts holding what fits of its stages' models for the first mix,
        GPU i starting from kind i (so the fleet starts spread over the kinds)."""
        kinds = [k for k, _ in self.o.workload.kinds]
        for i, g in enumerate(self.gpus):
            g.cache = ModelCache(self._budget(g))
            order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
            for k in order:
                g.cache.preload(self._gpu_models(g, [k]))

    def _gpu_load(self, w: WorkerView) -> int:
        gpu = self.gpu_of[w.labels["gpu"]]
        return len(gpu.queue) + (gpu.running is not None)

    def _prefer(self, item: WorkItem, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        """Routing preference: the candidates whose GPU holds what ``item`` needs; if
        none, those that load the fewest GB for it (a paused job's weights evicted
        only where no candidate avoids it)."""
        rec = self.o.records[item.request_id]
        gpus = [self.gpu_of.get(w.labels.get("gpu", "")) for w in candidates]
        needs: list[list[Model]] = [
            []
            if gpu is None or gpu.cache is None
            else self._models(rec.kind, item.stage, gpu, not rec.encode_skipped)
            for gpu in gpus
        ]
        warm = [
            w
            for w, gpu, m in zip(candidates, gpus, needs, strict=True)
            if gpu is None or gpu.cache is None or gpu.cache.holds(m)
        ]
        if warm:
            return warm
        gb = [
            g.cache.missing_gb(m, self._pinned(g))  # type: ignore[union-attr]
            for g, m in zip(gpus, needs, strict=True)
        ]
        least = min(gb)
        return [w for w, x in zip(candidates, gb, strict=True) if x == least]

    def _pinned(self, gpu: _Gpu) -> set[tuple[str, str]]:
        """The DiT weights of the denoise job running on a host GPU and of those paused
        there (they resume there): an Encode or Decode item between its steps does not
        evict them unless nothing else makes room."""
        if gpu.pool != "host":
            return set()
        out = {
            ("dit", self.o.records[it.request_id].kind.name)
            for _, it in gpu.queue
            if it.stage == "denoise" and it.request_id in self.paused
        }
        run = gpu.running
        if run is not None and run.item.stage == "denoise":
            out.add(("dit", self.o.records[run.item.request_id].kind.name))
        return out

    def _load_s(self, gpu: _Gpu, kind: RequestKind, stage: str, encode: bool = True) -> float:
        """Seconds ``gpu`` spends loading what an item needs (0 when it holds it)."""
        if gpu.cache is None:
            return 0.0
        models = self._models(kind, stage, gpu, encode)
        return gpu.cache.need(models, self._pinned(gpu)) / LOAD_GBPS

    # ------------------------------------------------------------ service times
    def _placement(self, kind: RequestKind, role: str) -> Placement:
        """The penalty a GPU in ``role`` ("colocated", "denoise", "aux") pays for ``kind``."""
        key = (kind.name, role)
        pl = self._placements.get(key)
        if pl is None:
            lay, mech = self.o.layout, self.o.mech
            if role == "colocated" or not mech.fit_memory:
                pl = placement_penalty(kind, lay.gpu, True, True, True)
            elif role == "denoise":
                pl = placement_penalty(kind, lay.gpu, False, True, not mech.decode_off_dit)
            else:
                pl = placement_penalty(kind, lay.aux_type, True, False, mech.decode_off_dit)
            self._placements[key] = pl
            if pl.offload and (kind.offload_step_s is None or kind.offload_encode_s is None):
                self.unfit.add(f"{kind.name}@{role}")
        return pl

    def _role(self, gpu: _Gpu, stage_role: str) -> str:
        """The placement role of ``gpu``: a colocated or fractional host GPU holds all
        three stages; otherwise ``stage_role`` ("denoise" or "aux")."""
        return "colocated" if gpu.pool in ("colocated", "host") else stage_role

    def _encode_s(self, kind: RequestKind, gpu: _Gpu) -> float:
        """Encode time; the shared negative prompt is always cached per instance."""
        role = self._role(gpu, "aux")
        pl = self._placement(kind, role)
        t = kind.offload_encode_s if pl.offload and kind.offload_encode_s else kind.encode_s
        if gpu.pool == "aux":
            t *= self.o.layout.aux_type.slowdown_vs(self.o.layout.gpu)
        if self.o.workload.cache_negative:
            t *= 1.0 - kind.negative_share
        return t

    def _step_s(self, kind: RequestKind, gpu: _Gpu) -> float:
        role = self._role(gpu, "denoise")
        if self._placement(kind, role).offload and kind.offload_step_s:
            return kind.offload_step_s
        return kind.step_s

    def _decode_s(self, kind: RequestKind, on_dit: bool, gpu: _Gpu) -> float:
        """Whole-request decode time on the DiT's GPU (``on_dit``) or on an aux GPU."""
        pl = self._placement(kind, self._role(gpu, "denoise" if on_dit else "aux"))
        t = kind.decode_s * (kind.decode_tile_factor if pl.tile else 1.0)
        if gpu.pool == "aux":
            t *= self.o.layout.aux_type.slowdown_vs(self.o.layout.gpu)
        return t

"""The cluster simulator's model: what a run takes and what it returns.

    Workload    a request mix (kinds and shares, prompt repeats, a later mix)
    Layout      the cluster: GPUs, the split, node size, GPU types, the planner
    Mechanisms  the switches only disaggregation brings
    Scheduler   the one ``OrchestratorConfig`` every layout runs under
    RunResult   a run's ``RequestRecord``s and accounting (``metrics.summarize``)

``cluster.simulate`` runs them (its module docstring says what each field does to
a run); ``default_aux`` sizes the aux pool by the stage-time ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig, SloClass
from mooncake_diffusion.simulate.arrivals import Arrivals, Poisson
from mooncake_diffusion.simulate.costs import H100, GpuType, RequestKind

__all__ = [
    "Layout",
    "Mechanisms",
    "Memory",
    "Mode",
    "RequestRecord",
    "RunResult",
    "Scheduler",
    "Workload",
    "default_aux",
]

Mode = Literal["colocated", "disaggregated", "flex", "elastic"]
Memory = Literal["resident", "swap"]
_NEVER = 1e15  # heartbeat timeout: simulated workers do not die


_SHIPPED = OrchestratorConfig()


@dataclass(frozen=True)
class Scheduler:
    """The orchestrator's settings, the same for every layout: the shipped defaults
    (``OrchestratorConfig``) unless a field is changed here, which changes it for both
    sides. ``priorities``: interactive before batch in every queue; ``preemption``:
    a batch denoise job yields at a step boundary to a waiting interactive one."""

    priorities: bool = True
    preemption: bool = True
    max_preemptions: int = _SHIPPED.max_preemptions

    def config(self) -> OrchestratorConfig:
        """The one ``OrchestratorConfig`` both layouts run under."""
        batch_priority = 1 if self.priorities else 0
        classes = (
            SloClass("interactive", priority=0, deadline=1e9),
            SloClass("batch", priority=batch_priority, deadline=1e9),
        )
        return OrchestratorConfig(
            classes=classes,
            heartbeat_timeout=_NEVER,
            preemption=self.preemption and self.priorities,
            max_preemptions=self.max_preemptions,
        )

    def changed(self) -> dict[str, object]:
        """The settings that differ from the shipped core (printed with results)."""
        cfg = self.config()
        out: dict[str, object] = {}
        for name in ("preemption", "max_preemptions"):
            if getattr(cfg, name) != getattr(_SHIPPED, name):
                out[name] = getattr(cfg, name)
        return out


@dataclass(frozen=True)
class Mechanisms:
    """Which mechanisms only disaggregation brings are on (see ``cluster``'s module docstring).
    ``cross_instance_cache`` may also be turned on for colocated serving."""

    fit_memory: bool = True
    decode_off_dit: bool = True
    shared_decode: bool = True
    cross_instance_cache: bool = True

    @classmethod
    def none(cls) -> Mechanisms:
        return cls(False, False, False, False)

    def without(self, name: str) -> Mechanisms:
        return replace(self, **{name: False})


@dataclass(frozen=True)
class Workload:
    """A request mix: ``(kind, share of arrivals)``. ``prompt_repeat``: the share of
    requests whose positive prompt was seen before (0.25: DiffusionDB 2M has 1.5M
    unique prompts in 2M requests, docs/sources.md). ``later``: a second mix that
    replaces ``kinds`` from ``shift_at`` x the horizon on (a shifting mix).
    ``cache_negative``: every instance keeps the shared negative prompt's embedding
    (both layouts; off to reproduce an engine run without any cache)."""

    name: str
    kinds: tuple[tuple[RequestKind, float], ...]
    prompt_repeat: float = 0.25
    later: tuple[tuple[RequestKind, float], ...] | None = None
    shift_at: float = 0.5
    cache_negative: bool = True

    @staticmethod
    def _mean(kinds: tuple[tuple[RequestKind, float], ...]) -> float:
        total = sum(s for _, s in kinds)
        return sum(k.isolated_s * s for k, s in kinds) / total

    def mean_gpu_seconds(self) -> float:
        """Mean isolated GPU-seconds per request over the run (what a load of 1.0
        saturates); with ``later``, weighted by the time each mix lasts."""
        if self.later is None:
            return self._mean(self.kinds)
        a, b = self._mean(self.kinds), self._mean(self.later)
        return self.shift_at * a + (1 - self.shift_at) * b

    def stage_seconds(self) -> tuple[float, float, float]:
        """Mean (encode, denoise, decode) seconds per request of the first mix (what
        pools are sized for)."""
        total = sum(s for _, s in self.kinds)
        e = sum(k.encode_s * s for k, s in self.kinds) / total
        d = sum(k.denoise_s * s for k, s in self.kinds) / total
        v = sum(k.decode_s * s for k, s in self.kinds) / total
        return e, d, v


@dataclass(frozen=True)
class Layout:
    """The cluster: ``gpus`` in all, of type ``gpu``; for disaggregated serving
    ``aux`` of them host the encode and decode workers and are of type ``aux_gpu``
    (None: the same as ``gpu``); ``split_aux``: with two or more, Encode and Decode on
    alternate aux GPUs instead of both on each (single-stage GPUs a planner may move).
    ``planner``: the ``elastic`` layout's planner, a registry name. ``aux=0`` is the
    fractional split: Encode and Decode
    workers run on ``hosts`` of the denoise GPUs, sharing their time and memory (a
    host GPU holds all three stages' weights, so it pays the colocated placement).
    ``node_gpus``: node size when decode pools are not shared."""

    mode: Mode
    gpus: int
    aux: int = 1
    node_gpus: int = 8
    gpu: GpuType = H100
    aux_gpu: GpuType | None = None
    hosts: int = 1
    planner: str | None = None
    split_aux: bool = False

    def __post_init__(self) -> None:
        if self.mode in ("flex", "elastic") and self.aux_gpu is not None:
            raise ValueError(f"{self.mode}: every GPU is of one type (aux_gpu must be None)")
        if self.mode == "elastic" and not self.planner:
            raise ValueError("elastic: name a planner (Layout.planner, e.g. 'reactive')")
        if self.split_aux and self.mode not in ("disaggregated", "elastic"):
            raise ValueError("split_aux: Encode and Decode GPUs exist only with aux GPUs")

    @property
    def split(self) -> str:
        """The split as ``denoise:aux`` GPUs (``denoise:0+hosts`` for fractional)."""
        if self.mode == "colocated":
            return f"{self.gpus}:0 colocated"
        if self.mode == "flex":
            return f"{self.gpus} flex"
        if self.mode == "elastic":
            start = replace(self, mode="disaggregated", planner=None).split
            return f"{start} elastic ({self.planner})"
        if self.split_aux and self.aux >= 2:
            return f"{self.gpus - self.aux}:{self.aux} (E {(self.aux + 1) // 2}, V {self.aux // 2})"
        aux = f"{self.aux} {self.aux_gpu.name}" if self.aux_gpu else str(self.aux)
        if self.aux == 0:
            return f"{self.gpus}:0 (E+V on {self.hosts} DiT GPU)"
        return f"{self.gpus - self.aux}:{aux}"

    @property
    def aux_type(self) -> GpuType:
        return self.aux_gpu if self.aux_gpu is not None else self.gpu

    def price_per_hour(self, aux_count: int | None = None) -> float:
        """USD per hour for the cluster's GPUs (``aux_count``: aux GPUs really placed)."""
        if self.mode in ("colocated", "flex", "elastic"):
            return self.gpus * self.gpu.price_per_hour
        n = self.aux if aux_count is None else aux_count
        return (self.gpus - n) * self.gpu.price_per_hour + n * self.aux_type.price_per_hour


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
    """A run's records and accounting; ``config`` is the core's configuration and
    ``price_per_hour`` the cluster's GPU price (USD/h). ``cannot_fit``: the
    ``kind@role`` placements that needed weights offloaded where no measured offload
    time exists (their stage times are then not a measurement: report, do not use).
    ``memory``: the memory rule it ran under; ``loaded_gb``: weights loaded (model
    swaps and stage changes, ``memory="swap"``); ``stage_changes``: ``(time, gpu,
    from stages, to stages)`` of each move an elastic run began; ``planner``: its
    name, options, decisions and GPU-seconds spent loading for stage changes."""

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
    config: OrchestratorConfig
    price_per_hour: float
    cannot_fit: list[str] = field(default_factory=list)
    memory: Memory = "resident"
    loaded_gb: float = 0.0
    stage_changes: list[tuple[float, str, tuple[str, ...], tuple[str, ...]]] = field(
        default_factory=list
    )
    planner: dict[str, object] | None = None


@dataclass
class _Options:
    """One run's arguments (``simulate()``'s, resolved) and the records it
    fills, one per submitted request (written by ``cluster._Sim`` only)."""

    workload: Workload
    layout: Layout
    mech: Mechanisms
    sched: Scheduler
    seed: int
    rate: float | None
    horizon: float
    closed: tuple[int, int] | None  # (concurrency, total)
    warmup: float
    arrivals: Arrivals = field(default_factory=Poisson)
    memory: Memory = "resident"
    records: dict[str, RequestRecord] = field(default_factory=dict)

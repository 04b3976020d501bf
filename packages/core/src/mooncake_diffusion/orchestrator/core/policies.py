"""Built-in routing policies (registered as ``round_robin``, ``least_loaded``, ``affinity``).

Each is a few lines over the ``RoutingPolicy`` contract in ``routing.py``: pure
functions of the candidates plus, for round robin, a cursor per stage. Ties
always break by registration order, so runs are reproducible. ``choose`` is the
reference; ``index()`` gives the core the same choices without a scan of the
pool (``indexes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mooncake_diffusion.orchestrator.core.indexes import (
    AffinityIndex,
    LeastLoadedIndex,
    RoundRobinIndex,
)
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.core.routing import WorkerView
from mooncake_diffusion.orchestrator.errors import OrchestratorConfigError

__all__ = ["AffinityLeastLoaded", "LeastLoaded", "RoundRobin"]


def _load_key(w: WorkerView) -> tuple[float, int, int]:
    # fraction of advertised credits in use, then more free credits first, then age
    return (w.held / w.advertised, -w.free, w.seq)


def _own(policy: object, cls: type) -> bool:
    """Whether ``policy`` decides with ``cls.choose`` (not a subclass's override)."""
    return type(policy).choose is cls.choose  # type: ignore[attr-defined]


class RoundRobin:
    """Each stage's workers in turn, by registration order, skipping those with no credit."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def choose(self, item: WorkItem, candidates: Sequence[WorkerView]) -> WorkerView:
        last = self._last.get(item.stage, -1)
        pick = candidates[0]
        for w in candidates:
            if w.seq > last:
                pick = w
                break
        self._last[item.stage] = pick.seq
        return pick

    def index(self) -> RoundRobinIndex | None:
        """The same choices in O(log n) (``indexes.py``); shares this policy's cursor.
        None for a subclass with its own ``choose`` (the core then calls that)."""
        return RoundRobinIndex(self._last) if _own(self, RoundRobin) else None


class LeastLoaded:
    """The worker with the smallest share of its credits in use."""

    def choose(self, item: WorkItem, candidates: Sequence[WorkerView]) -> WorkerView:
        return min(candidates, key=_load_key)

    def index(self) -> LeastLoadedIndex | None:
        """The same choices in O(log n) amortised (``indexes.py``); None for a
        subclass with its own ``choose``."""
        return LeastLoadedIndex() if _own(self, LeastLoaded) else None


class AffinityLeastLoaded:
    """Prefer workers whose labels match the item's producer; least loaded among equals.

    ``keys`` are compared in order, most important first: a worker on the
    producer's node beats one on the same rail elsewhere, which beats no match.
    Workers with no match are the fallback, so an item never waits for affinity.
    An item without a hint (the first stage) goes least loaded.
    """

    def __init__(self, keys: Sequence[str] = ("node", "rail", "numa")) -> None:
        if isinstance(keys, str) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise OrchestratorConfigError(f"affinity keys must be label names, got {keys!r}")
        self.keys = tuple(keys)

    def score(self, hint: Mapping[str, str], labels: Mapping[str, str]) -> int:
        """A bit per matching key, the first key highest: compare scores as integers."""
        s = 0
        for k in self.keys:
            s <<= 1
            v = hint.get(k)
            if v is not None and labels.get(k) == v:
                s |= 1
        return s

    def choose(self, item: WorkItem, candidates: Sequence[WorkerView]) -> WorkerView:
        hint = item.hint
        if not hint:
            return min(candidates, key=_load_key)
        best = candidates[0]
        best_key = (-self.score(hint, best.labels), *_load_key(best))
        for w in candidates[1:]:
            key = (-self.score(hint, w.labels), *_load_key(w))
            if key < best_key:
                best, best_key = w, key
        return best

    def index(self) -> AffinityIndex | None:
        """The same choices from 2**len(keys) heaps (``indexes.py``); None for a
        subclass with its own ``choose`` or ``score``."""
        own = _own(self, AffinityLeastLoaded) and type(self).score is AffinityLeastLoaded.score
        return AffinityIndex(self.keys) if own else None

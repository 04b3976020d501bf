"""What a GPU holds: the models resident in its memory, loaded on demand.

The memory rule of ``simulate(..., memory="swap")``, one rule for every layout
(colocated, disaggregated, flex, elastic), so that no layout gets memory for free:

- A GPU offers ``usable_gb`` minus the decode peak it must keep free when it
  decodes (the largest decode peak of the mix's kinds, tiled where its placement
  tiles) to weights: ``budget_gb``.
- An item needs its stage's model of its kind: Encode the encoder, Denoise the
  DiT, a colocated whole request both (the encoder only when it encodes). A model
  not resident is loaded at ``costs.LOAD_GBPS`` before the item starts (the GPU
  serves nothing meanwhile), evicting the least recently used models the item does
  not need until it fits.
- A kind whose placement on that GPU offloads weights is not cached: its measured
  offloaded times already price moving its weights (``costs.placement_penalty``).

``memory="resident"`` (the default, issue 29's runs) assumes every GPU holds every
model of its mix, which the memory table shows is not physical for multi-model
mixes on one GPU.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence, Set

__all__ = ["Model", "ModelCache"]

#: (part, kind name), e.g. ("dit", "qwen-1024"), and its size in GB
Model = tuple[tuple[str, str], float]


class ModelCache:
    """The models resident on one GPU, least recently used first. ``loaded_gb`` and
    ``loads`` count what it loaded (preloading at build time is free)."""

    __slots__ = ("budget", "loaded_gb", "loads", "resident")

    def __init__(self, budget_gb: float) -> None:
        self.budget = budget_gb
        self.resident: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.loaded_gb = 0.0
        self.loads = 0

    def holds(self, models: Sequence[Model]) -> bool:
        """Whether every model of ``models`` that can be resident is."""
        res = self.resident
        return all(key in res or gb > self.budget for key, gb in models)

    def preload(self, models: Sequence[Model]) -> None:
        """Make ``models`` resident at no cost if they fit beside what is there."""
        free = self.budget - sum(self.resident.values())
        want = [(k, gb) for k, gb in models if k not in self.resident]
        if sum(gb for _, gb in want) <= free:
            for k, gb in want:
                self.resident[k] = gb

    def missing_gb(
        self, models: Sequence[Model], pinned: Set[tuple[str, str]] = frozenset()
    ) -> float:
        """GB ``need`` would load; plus ``math.inf`` when they do not fit without
        evicting a ``pinned`` model (the weights of a job paused on this GPU)."""
        missing = [(k, gb) for k, gb in models if k not in self.resident and gb <= self.budget]
        if not missing:
            return 0.0
        gb_in = sum(gb for _, gb in missing)
        keep = sum(gb for k, gb in self.resident.items() if k in pinned)
        return gb_in if keep + gb_in <= self.budget else math.inf

    def need(self, models: Sequence[Model], pinned: Set[tuple[str, str]] = frozenset()) -> float:
        """Make ``models`` resident (most recently used), evicting the least recently
        used models other than these and ``pinned`` ones (a pinned model goes only
        if nothing else makes room); returns the GB loaded."""
        keys = {k for k, _ in models}
        missing = [(k, gb) for k, gb in models if k not in self.resident and gb <= self.budget]
        for k, _ in models:
            if k in self.resident:
                self.resident.move_to_end(k)
        if not missing:
            return 0.0
        gb_in = sum(gb for _, gb in missing)
        used = sum(self.resident.values())
        for spare_pinned in (True, False):
            for k in list(self.resident):
                if used + gb_in <= self.budget:
                    break
                if k not in keys and not (spare_pinned and k in pinned):
                    used -= self.resident.pop(k)
        for k, gb in missing:
            self.resident[k] = gb
        self.loaded_gb += gb_in
        self.loads += 1
        return gb_in

    def rebudget(self, budget_gb: float) -> None:
        """The GPU's role changed: a new budget; evict least recently used to fit."""
        self.budget = budget_gb
        used = sum(self.resident.values())
        for k in list(self.resident):
            if used <= budget_gb:
                break
            used -= self.resident.pop(k)

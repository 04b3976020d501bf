"""The routing-policy contract: which worker of a pool takes the next item.

The core owns *when* an item is dispatched (queue order, credits, decode
reservations); a policy only picks *where*, among workers that can take it.
Call sequence, all on the core's thread, inside ``Orchestrator.handle``:

    policy = create_policy("affinity")          # once (registry.py), or any object
    core = Orchestrator(config, policy=policy)  #   with this shape
    ... for every dispatch decision the core makes:
    worker = policy.choose(item, candidates)

Policies are named in a lazy, strict registry (``registry.py``); built-ins
are in ``policies.py``. Optional: a policy with an ``index()`` method returning
a ``RoutingIndex`` (``indexes.py``), or None, lets the core decide without
building the candidate list (O(workers) per decision); the index must pick
exactly what ``choose`` would. The built-ins have one; ``choose`` alone is
enough for any other policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from mooncake_diffusion.orchestrator.core.model import Stage, WorkItem

__all__ = ["RoutingPolicy", "WorkerView"]


class WorkerView(Protocol):
    """What a policy may read about a worker. Read-only: never mutate it.

    ``seq`` orders workers by registration (unique, increasing). ``stages``: every
    stage it serves (``stage`` is the first); its credits are shared by all of
    them, so a worker is a candidate of each of its stages. ``advertised``
    is the worker's credit advertisement, ``held`` the credits its running
    items hold, ``free`` how many more items it may take now.
    """

    @property
    def worker_id(self) -> str: ...
    @property
    def stage(self) -> Stage: ...
    @property
    def stages(self) -> tuple[Stage, ...]: ...
    @property
    def seq(self) -> int: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def advertised(self) -> int: ...
    @property
    def held(self) -> int: ...
    @property
    def free(self) -> int: ...


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses the worker for one dispatch.

    ``choose`` is called once per dispatch decision with a non-empty
    ``candidates`` sequence: every serving worker that holds ``item.stage`` with
    ``free >= 1``, in registration order. It must return one of those objects
    (not a copy), must not block, and must be deterministic given the same
    sequence of calls (any state it keeps is its own, e.g. a round-robin
    cursor; seed any randomness in ``__init__``). It is not told about
    completions; the loads it sees are current at each call. Returning
    anything else, or raising, makes the core raise ``PolicyContractError``.
    """

    def choose(self, item: WorkItem, candidates: Sequence[WorkerView]) -> WorkerView: ...

"""Typed structs of the orchestrator: configuration, events in, actions out.

Everything here is a frozen msgspec struct, so a service can carry events and
actions over a wire unchanged (``tag=True``: a union of them decodes by type
name). Field *types* are the driver's to get right (msgspec checks them when it
decodes an event); field *values* are the core's to check: it answers a bad
value, or an event that does not fit the current state, with ``Rejected`` (see
``RejectCode``). Event construction does not validate. Configuration structs
do, in ``__post_init__``, and raise ``OrchestratorConfigError``.

Events (driver -> core)            Actions (core -> driver)
    Submit          a new request      Dispatch          send an item to a worker
    Cancel          stop a request     Revoke            tell a worker to drop an item
    RegisterWorker  a worker joins     Requeued          an item went back to its queue
    Heartbeat       alive (+ credits)  RequestCompleted  the final output, to the client
    WorkerLost      a worker is gone   RequestFailed     attempts exhausted, with reasons
    ItemDone        output published   RequestCancelled  the cancel took effect
    ItemFailed      a worker gave up   ReleasePayloads   drop what a finished request holds
    ItemYielded     stopped on request WorkerRemoved     a worker left or missed its deadline
    Tick            time passed        Preempt           ask a worker to yield a denoise job
    Reassign        change stages      Rerun             an input was lost: its stage again
    Drain           a worker leaves    LoadStages        a drained worker loads new stages
                                       Rejected          a bad event, ignored; says why
Payload handles (``params``, ``input``, ``output``) are opaque bytes of at most
``MAX_HANDLE_BYTES``; the tensors they name move through the connector.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mooncake_diffusion.orchestrator.errors import OrchestratorConfigError

__all__ = [
    "MAX_HANDLE_BYTES",
    "MAX_ID",
    "STAGES",
    "Action",
    "Cancel",
    "CoreSnapshot",
    "Dispatch",
    "Drain",
    "Event",
    "Heartbeat",
    "ItemDone",
    "ItemFailed",
    "ItemYielded",
    "LoadStages",
    "OrchestratorConfig",
    "Preempt",
    "Reassign",
    "RegisterWorker",
    "RejectCode",
    "Rejected",
    "ReleasePayloads",
    "RequestCancelled",
    "RequestCompleted",
    "RequestFailed",
    "RequestSnapshot",
    "Requeued",
    "Rerun",
    "Revoke",
    "SloClass",
    "Stage",
    "Submit",
    "Tick",
    "WorkItem",
    "WorkerLost",
    "WorkerRemoved",
    "WorkerSnapshot",
    "WorkerState",
]

Stage = Literal["encode", "denoise", "decode"]
#: The stage graph, in order. A request whose embeddings are cached skips "encode".
STAGES: tuple[Stage, ...] = ("encode", "denoise", "decode")

MAX_ID = 256
MAX_HANDLE_BYTES = 64 * 1024
MAX_LABELS = 16

RejectCode = Literal[
    "bad_event",  # not an event type the core knows
    "bad_value",  # a field out of range: empty id, negative credits, oversize handle
    "unknown_stage",
    "unknown_class",
    "duplicate_request",  # the id is live or finished recently
    "unknown_request",  # never submitted (or finished too long ago to remember)
    "already_finished",  # cancel of a request that completed, failed or was cancelled
    "duplicate_worker",  # a live worker already has this id (and is not loading new stages)
    "not_serving",  # Reassign/Drain of a worker already changing stage, loading or draining
    "unknown_worker",  # never registered, or declared dead: register again
    "not_held",  # the worker does not hold that (request, stage, attempt)
    "stale_attempt",  # a result for an attempt that is no longer current: dropped
]


def _fail(msg: str) -> None:
    raise OrchestratorConfigError(msg)


# --------------------------------------------------------------------------- configuration
class SloClass(msgspec.Struct, frozen=True):
    """A priority and SLO class.

    ``priority``: lower is served first in every queue. ``deadline``: seconds
    from submit; the target reported in ``RequestCompleted.deadline_met``.
    ``max_wait``: the bounded wait. Once an item of this class has waited that
    long in one queue it is served before every item that is not yet overdue
    (overdue items go in the order they became overdue), so it cannot starve;
    ``None`` means priority order only.
    """

    name: str
    priority: int
    deadline: float
    max_wait: float | None = None

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_ID:
            _fail(f"class name must be 1..{MAX_ID} characters, got {self.name!r}")
        if not self.deadline > 0:
            _fail(f"class {self.name!r}: deadline must be > 0, got {self.deadline}")
        if self.max_wait is not None and not self.max_wait >= 0:
            _fail(f"class {self.name!r}: max_wait must be >= 0 or None, got {self.max_wait}")


DEFAULT_CLASSES = (
    SloClass("interactive", priority=0, deadline=30.0),
    SloClass("batch", priority=1, deadline=3600.0, max_wait=60.0),
)


class OrchestratorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the core schedules. Validated at construction.

    ``max_attempts``: dispatches of one stage of one request before it fails.
    ``heartbeat_timeout``: seconds a worker may stay silent (any event from it
    counts) before it is declared dead and its items go back to their queues;
    ``RegisterWorker`` may set its own. ``policy``: a routing policy name in the
    registry (used when the core is built without a policy instance).
    ``finished_memory``: how many finished request ids are remembered, to
    reject duplicate submits and to name late results as stale.
    """

    classes: tuple[SloClass, ...] = DEFAULT_CLASSES
    default_class: str = "interactive"
    max_attempts: int = 3
    heartbeat_timeout: float = 10.0
    policy: str = "affinity"
    finished_memory: int = 65536
    #: Step-boundary preemption of denoise jobs (see ``Preempt``); off by default.
    preemption: bool = False
    #: How often one request may be preempted (a bound, so it cannot starve).
    max_preemptions: int = 2
    #: How often a stage whose input was lost (``ItemFailed.input_lost``: the store
    #: host or the producer died with it) may send its request back to re-run the
    #: stage that made the input (see ``Rerun``). 0: such a failure is an ordinary one.
    max_reruns: int = 2

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            _fail("at least one SLO class is needed")
        if len(set(names)) != len(names):
            _fail(f"SLO class names repeat: {names}")
        if self.default_class not in names:
            _fail(f"default_class {self.default_class!r} is not one of {names}")
        if self.max_attempts < 1:
            _fail(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.heartbeat_timeout > 0:
            _fail(f"heartbeat_timeout must be > 0, got {self.heartbeat_timeout}")
        if self.finished_memory < 0:
            _fail(f"finished_memory must be >= 0, got {self.finished_memory}")
        if self.max_preemptions < 0:
            _fail(f"max_preemptions must be >= 0, got {self.max_preemptions}")
        if self.max_reruns < 0:
            _fail(f"max_reruns must be >= 0, got {self.max_reruns}")


# --------------------------------------------------------------------------- the work item
class WorkItem(msgspec.Struct, frozen=True, gc=False):
    """One stage of one request, as a worker receives it.

    ``attempt`` counts dispatches of this stage of this request, from 1; a
    worker echoes ``(request_id, stage, attempt)`` in its result. ``params`` is
    the request's opaque descriptor (same for every stage). ``input`` is the
    upstream stage's output handle (the cached embeddings when Encode was
    skipped; empty for the first stage). ``hint`` holds the labels of the
    worker that produced ``input`` ({} if none), for affinity.

    Not tracked by the garbage collector (``gc=False``): a fleet has thousands of
    items in flight, and a collector that rescans each of them costs every decision
    more as the fleet grows. Its fields are strings, numbers, bytes and a dict of
    strings, so it cannot be part of a reference cycle (never put an item in its
    own ``hint``).
    """

    request_id: str
    stage: Stage
    attempt: int
    slo_class: str
    deadline: float
    params: bytes
    input: bytes
    hint: dict[str, str]


# --------------------------------------------------------------------------- events
class Submit(msgspec.Struct, frozen=True, tag=True):
    """A client request. ``slo_class=None`` means the configured default.

    ``cached_embeddings``: the handle of condition embeddings the cache already
    holds; when given, Encode is skipped and it becomes Denoise's input.
    ``deadline``: absolute time; ``None`` means submit time + the class deadline.
    """

    request_id: str
    slo_class: str | None = None
    params: bytes = b""
    cached_embeddings: bytes | None = None
    deadline: float | None = None


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """Stop a queued or running request; its credits are released at once."""

    request_id: str
    reason: str = "cancelled by client"


class RegisterWorker(msgspec.Struct, frozen=True, tag=True):
    """A worker (or a denoise worker group, by its leader) joins ``stage``'s pool.

    ``credits``: free receive slots it advertises (items it may hold at once),
    shared by every stage it holds. ``labels``: topology, e.g.
    ``{"node": "n3", "rail": "1", "numa": "0"}``. ``stages``: every stage whose
    model it has loaded, ``stage`` among them (empty: ``stage`` alone); the core
    dispatches any of them to it. A worker that answered ``LoadStages``
    registers again under the same id with the new ``stages``.
    """

    worker_id: str
    stage: str
    credits: int = 1
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    heartbeat_timeout: float | None = None
    stages: tuple[str, ...] = ()


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """The worker is alive; ``credits`` (if given) re-advertises its slots."""

    worker_id: str
    credits: int | None = None


class WorkerLost(msgspec.Struct, frozen=True, tag=True):
    """The worker is gone (its supervisor saw it exit, or it left); its items are re-queued."""

    worker_id: str
    reason: str = "worker lost"


class ItemDone(msgspec.Struct, frozen=True, tag=True):
    """The worker published the item's output (``output`` is its handle) and acknowledges it."""

    worker_id: str
    request_id: str
    stage: str
    attempt: int
    output: bytes = b""


class ItemFailed(msgspec.Struct, frozen=True, tag=True):
    """The worker gave the item up; ``retryable=False`` fails the request at once.
    ``input_lost``: the item's input payload is gone (not merely late), so only
    re-running the stage that produced it can help (see ``Rerun``)."""

    worker_id: str
    request_id: str
    stage: str
    attempt: int
    reason: str
    retryable: bool = True
    input_lost: bool = False


class ItemYielded(msgspec.Struct, frozen=True, tag=True):
    """The worker stopped the item at a step boundary, as a ``Preempt`` asked; the job
    goes back to its queue (its progress lives in the step-checkpoint cache) and the
    dispatch does not count against ``max_attempts``."""

    worker_id: str
    request_id: str
    stage: str
    attempt: int


class Reassign(msgspec.Struct, frozen=True, tag=True):
    """Move a live worker to ``stages`` (a planner's decision). The core dispatches
    nothing more to it; its running denoise jobs get ``Preempt`` (they resume
    elsewhere from their step checkpoint; not counted against ``max_preemptions``);
    its encode and decode items finish (or are yielded back). Once it holds
    nothing the core emits ``LoadStages``; the worker stays live (heartbeats keep
    it so) until it registers again with the new stages."""

    worker_id: str
    stages: tuple[str, ...]
    reason: str = "planner"


class Drain(msgspec.Struct, frozen=True, tag=True):
    """A worker is leaving (scale-down, or a SIGTERM notice): nothing more is
    dispatched to it, its running denoise jobs get ``Preempt`` (resumed elsewhere
    from their step checkpoint), its encode and decode items finish or are
    yielded back (``ItemYielded`` is accepted from a draining worker for any
    item, and is not a failed attempt). Once it holds nothing the core emits
    ``WorkerRemoved`` with the reason and the worker may exit."""

    worker_id: str
    reason: str = "draining"


class Tick(msgspec.Struct, frozen=True, tag=True):
    """Nothing but the passage of time (heartbeat deadlines are checked on every event)."""


Event = (
    Submit
    | Cancel
    | RegisterWorker
    | Heartbeat
    | WorkerLost
    | ItemDone
    | ItemFailed
    | ItemYielded
    | Reassign
    | Drain
    | Tick
)


# --------------------------------------------------------------------------- actions
class Dispatch(msgspec.Struct, frozen=True, tag=True, gc=False):
    """Send ``item`` to ``worker_id``; one credit of that worker is now held by it.
    Not tracked by the garbage collector, as ``WorkItem`` (no cycle can go through it)."""

    worker_id: str
    item: WorkItem


class Revoke(msgspec.Struct, frozen=True, tag=True):
    """Tell ``worker_id`` to drop an item (its request was cancelled); its credit is free."""

    worker_id: str
    request_id: str
    stage: Stage
    attempt: int
    reason: str


class Preempt(msgspec.Struct, frozen=True, tag=True):
    """Ask ``worker_id`` to stop a running denoise job at its next step boundary and
    answer ``ItemYielded`` (or ``ItemDone``, if it finished first): a job of a higher
    priority class waits and no denoise credit is free. The credit stays held until
    the answer comes. Emitted once per preemption (``OrchestratorConfig.preemption``)."""

    worker_id: str
    request_id: str
    stage: Stage
    attempt: int
    reason: str


class LoadStages(msgspec.Struct, frozen=True, tag=True):
    """A worker asked to change stage (``Reassign``) now holds nothing: it loads
    ``stages``' models (dropping the others) and answers ``RegisterWorker`` under
    the same id with ``stages=stages``. Until then it takes no work."""

    worker_id: str
    stages: tuple[Stage, ...]
    reason: str


class Requeued(msgspec.Struct, frozen=True, tag=True):
    """``attempt`` of the stage failed or its worker died; the item is queued again."""

    request_id: str
    stage: Stage
    attempt: int
    reason: str


class Rerun(msgspec.Struct, frozen=True, tag=True):
    """The input of ``lost_stage`` is gone (``ItemFailed.input_lost``): the request went
    back to ``stage``, the one that produced it, which is queued again (a new attempt;
    at most ``OrchestratorConfig.max_reruns`` times per request)."""

    request_id: str
    stage: Stage
    lost_stage: Stage
    reason: str


class RequestCompleted(msgspec.Struct, frozen=True, tag=True):
    """The request's final output (the last stage's output handle), for the client."""

    request_id: str
    output: bytes
    submitted_at: float
    finished_at: float
    deadline: float

    @property
    def deadline_met(self) -> bool:
        return self.finished_at <= self.deadline


class RequestFailed(msgspec.Struct, frozen=True, tag=True):
    """The request gave up: one reason per failed attempt, oldest first."""

    request_id: str
    reasons: tuple[str, ...]


class RequestCancelled(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    reason: str


class ReleasePayloads(msgspec.Struct, frozen=True, tag=True):
    """A request finished (any outcome): drop whatever it still holds.

    ``handles`` are the intermediate outputs its stages produced (not the
    client's cached embeddings, not the final output). Emitted exactly once per
    request; the executor applies each handle's lease (shared embeddings stay
    cached) and must treat already-gone payloads as done.
    """

    request_id: str
    handles: tuple[bytes, ...]


class WorkerRemoved(msgspec.Struct, frozen=True, tag=True):
    """A worker left the pool (lost or missed its heartbeat deadline).

    ``requeued`` and ``failed`` list the request ids it held, by outcome.
    """

    worker_id: str
    reason: str
    requeued: tuple[str, ...]
    failed: tuple[str, ...]


class Rejected(msgspec.Struct, frozen=True, tag=True):
    """An event was ignored; nothing else changed. ``event`` is its type name."""

    code: RejectCode
    reason: str
    event: str


Action = (
    Dispatch
    | Revoke
    | Preempt
    | LoadStages
    | Requeued
    | Rerun
    | RequestCompleted
    | RequestFailed
    | RequestCancelled
    | ReleasePayloads
    | WorkerRemoved
    | Rejected
)


# --------------------------------------------------------------------------- introspection
WorkerState = Literal["serving", "changing", "loading", "draining"]


class WorkerSnapshot(msgspec.Struct, frozen=True):
    """A live worker. ``held + free == max(advertised, held)``: credits held by
    running items are never revoked; a shrunk advertisement retires them as they
    return. ``stages``: every stage it serves (``stage`` is the first).
    ``state``: ``serving``; ``changing`` (a ``Reassign`` waits for its items);
    ``loading`` (``LoadStages`` sent, waiting for its new registration);
    ``draining`` (a ``Drain`` waits for its items)."""

    worker_id: str
    stage: Stage
    seq: int
    labels: dict[str, str]
    advertised: int
    held: int
    free: int
    expires_at: float
    running: tuple[str, ...]
    stages: tuple[Stage, ...] = ()
    state: WorkerState = "serving"


class RequestSnapshot(msgspec.Struct, frozen=True):
    """A live request. ``reserved``: it holds a decode credit reservation (denoise
    running on a worker that does not hold decode, or decode queued). ``yields``:
    dispatches that ended in ``ItemYielded`` (preemption, stage change, drain),
    which are not failed attempts: ``attempt - yields <= max_attempts``."""

    request_id: str
    slo_class: str
    stage: Stage
    state: Literal["queued", "running"]
    attempt: int
    worker_id: str | None
    reserved: bool
    queued_since: float
    yields: int = 0


class CoreSnapshot(msgspec.Struct, frozen=True):
    """The whole state, for metrics and invariant checks; O(size) to build."""

    now: float
    workers: tuple[WorkerSnapshot, ...]
    requests: tuple[RequestSnapshot, ...]
    queued: dict[str, tuple[str, ...]]
    free_credits: dict[str, int]
    decode_reserved: int
    finished: dict[str, str]

"""Queue-based multi-stage orchestration: the deterministic core and what runs it.

Events in, actions out. A driver (a network service, the worker runtime's
test double, the simulator) owns the I/O and the time; the core owns the
decisions. Call sequence:

    core = Orchestrator(OrchestratorConfig(), clock=VirtualClock())   # or MonotonicClock()
    core.handle(RegisterWorker("den-0", "denoise", credits=1, labels={"node": "n0"}))
    core.handle(RegisterWorker("dec-0", "decode", credits=2, labels={"node": "n0"}))
    acts = core.handle(Submit("r1", "interactive", params=b"...", cached_embeddings=h))
    #   -> [Dispatch("den-0", WorkItem(r1, denoise, attempt=1, ...))]; the driver sends it
    acts = core.handle(ItemDone("den-0", "r1", "denoise", 1, output=latent_handle))
    #   -> [Dispatch("dec-0", WorkItem(r1, decode, 1, input=latent_handle, ...))]
    acts = core.handle(ItemDone("dec-0", "r1", "decode", 1, output=video_handle))
    #   -> [RequestCompleted("r1", video_handle, ...), ReleasePayloads("r1", ...)]
    core.handle(Heartbeat("den-0"))           # every worker, well within its timeout
    core.handle(Tick())                       # at core.next_deadline() if nothing else came

Rooms, lowest first (a room imports only the rooms before it):
    errors.py    OrchestratorError and its subclasses
    core/        the deterministic machine: model, queues, pools, indexes, victims,
                 routing (the policy contract, built-ins, registry), clocks
    elastic/     the planner contract, built-in planners, their view, the driver
                 that applies decisions, provisioners
    link/        what the service and workers both speak: the wire, following
                 the leader's address, the inbox that wakes a loop
    worker/      StageWorker, the lost-input watch, the reference pipeline's and
                 toy stage functions
    service/     OrchestratorService: driver loop, worker channel, journal,
                 stall watch, status tables, metrics, the front process's bridge
    ha/          leader election on etcd and the leader-following service
    http/        the FastAPI app, OpenAI routes, front process, remote service, client
    commands.py  the ``orchestrator`` and ``worker`` commands

This face hands on the core's names and the journal's; the rest is imported
from its room.
"""

from mooncake_diffusion.orchestrator.core.clock import Clock, MonotonicClock, VirtualClock
from mooncake_diffusion.orchestrator.core.machine import Orchestrator
from mooncake_diffusion.orchestrator.core.model import (
    STAGES,
    Action,
    Cancel,
    CoreSnapshot,
    Dispatch,
    Drain,
    Event,
    Heartbeat,
    ItemDone,
    ItemFailed,
    ItemYielded,
    LoadStages,
    OrchestratorConfig,
    Preempt,
    Reassign,
    RegisterWorker,
    Rejected,
    ReleasePayloads,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    Requeued,
    Rerun,
    Revoke,
    SloClass,
    Stage,
    Submit,
    Tick,
    WorkerLost,
    WorkerRemoved,
    WorkerState,
    WorkItem,
)
from mooncake_diffusion.orchestrator.core.policies import (
    AffinityLeastLoaded,
    LeastLoaded,
    RoundRobin,
)
from mooncake_diffusion.orchestrator.core.registry import (
    ENTRY_POINT_GROUP,
    PolicyRegistry,
    create_policy,
    known_policies,
    load_policy,
    register_policy,
)
from mooncake_diffusion.orchestrator.core.routing import RoutingPolicy, WorkerView
from mooncake_diffusion.orchestrator.errors import (
    ClockError,
    OrchestratorConfigError,
    OrchestratorError,
    PolicyContractError,
)
from mooncake_diffusion.orchestrator.service.journal import (
    JOURNAL_SCHEMA_VERSION,
    Journal,
    JournaledOrchestrator,
    JournalError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "JOURNAL_SCHEMA_VERSION",
    "STAGES",
    "Action",
    "AffinityLeastLoaded",
    "Cancel",
    "Clock",
    "ClockError",
    "CoreSnapshot",
    "Dispatch",
    "Drain",
    "Event",
    "Heartbeat",
    "ItemDone",
    "ItemFailed",
    "ItemYielded",
    "Journal",
    "JournalError",
    "JournaledOrchestrator",
    "LeastLoaded",
    "LoadStages",
    "MonotonicClock",
    "Orchestrator",
    "OrchestratorConfig",
    "OrchestratorConfigError",
    "OrchestratorError",
    "PolicyContractError",
    "PolicyRegistry",
    "Preempt",
    "Reassign",
    "RegisterWorker",
    "Rejected",
    "ReleasePayloads",
    "RequestCancelled",
    "RequestCompleted",
    "RequestFailed",
    "Requeued",
    "Rerun",
    "Revoke",
    "RoundRobin",
    "RoutingPolicy",
    "SloClass",
    "Stage",
    "Submit",
    "Tick",
    "VirtualClock",
    "WorkItem",
    "WorkerLost",
    "WorkerRemoved",
    "WorkerState",
    "WorkerView",
    "create_policy",
    "known_policies",
    "load_policy",
    "register_policy",
]

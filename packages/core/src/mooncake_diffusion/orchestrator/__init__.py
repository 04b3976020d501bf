"""Queue-based multi-stage orchestration: the deterministic core.

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

Modules, one concern each:
    model.py     configuration, WorkItem, events, actions, snapshots (msgspec structs)
    clock.py     Clock protocol, MonotonicClock, VirtualClock, StallClock (the service's)
    queues.py    ClassQueue: priority classes, FIFO within, bounded wait
    pools.py     live workers, credits, heartbeat deadlines
    core.py      Orchestrator: the state machine and its rules
    policy.py    RoutingPolicy / WorkerView: the routing contract
    registry.py  lazy, strict policy registry (+ entry points)
    policies.py  round_robin, least_loaded, affinity
    indexes.py   the built-in policies' choices without a scan of the pool
    victims.py   the running denoise jobs in preemption order
    planner.py   the planner contract: PlannerView, Move/AddWorker/Retire, Provisioner
    planview.py  PlanWindow: a PlannerView from a snapshot and the driver's window
    planners.py  static, reactive, predictive, and the planner registry (+ entry points)
    elastic.py   Elastic: a planner's decisions as core events and provisioner calls
    provision.py LocalProvisioner: stage workers as local processes
    sim.py       a discrete-event cluster simulator over the real core
    journal.py   SQLite (WAL) event log; JournaledOrchestrator replays it on restart
    stalls.py    StallWatch: notices when the service's driver could not run
    errors.py    OrchestratorError and its subclasses
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
from mooncake_diffusion.orchestrator.core.policy import RoutingPolicy, WorkerView
from mooncake_diffusion.orchestrator.core.registry import (
    ENTRY_POINT_GROUP,
    PolicyRegistry,
    create_policy,
    known_policies,
    load_policy,
    register_policy,
)
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

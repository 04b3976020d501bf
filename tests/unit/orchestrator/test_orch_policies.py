"""Routing policies and their registry."""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass, field

import pytest
from orch_harness import Harness, one

from mooncake_diffusion.orchestrator import (
    ENTRY_POINT_GROUP,
    AffinityLeastLoaded,
    Dispatch,
    Heartbeat,
    LeastLoaded,
    OrchestratorConfigError,
    PolicyRegistry,
    RoundRobin,
    RoutingPolicy,
    Submit,
    WorkItem,
    create_policy,
    known_policies,
    load_policy,
    register_policy,
)

pytestmark = pytest.mark.unit


@dataclass
class W:
    """A plain WorkerView for policy unit tests."""

    worker_id: str
    seq: int
    advertised: int = 4
    held: int = 0
    stage: str = "decode"
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return max(0, self.advertised - self.held)


def item(stage: str = "decode", **hint: str) -> WorkItem:
    return WorkItem("r", stage, 1, "interactive", 1.0, b"", b"", dict(hint))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- built-ins
def test_round_robin_cycles_in_registration_order_per_stage():
    p = RoundRobin()
    ws = [W("a", 1), W("b", 2), W("c", 3)]
    assert [p.choose(item(), ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert p.choose(item(), [ws[0], ws[2]]).worker_id == "c"  # b is full: skipped
    assert p.choose(item("encode"), ws).worker_id == "a"  # its own cursor per stage
    assert p.choose(item(), ws).worker_id == "a"


def test_least_loaded_takes_the_smallest_share_in_use_then_the_oldest():
    p = LeastLoaded()
    ws = [W("a", 1, advertised=2, held=1), W("b", 2, advertised=8, held=2), W("c", 3, 8, 6)]
    assert p.choose(item(), ws).worker_id == "b"  # 25 % beats 50 % and 75 %
    ws = [W("a", 1, 4, 2), W("b", 2, 8, 4)]
    assert p.choose(item(), ws).worker_id == "b"  # equal share: more free credits
    ws = [W("a", 1, 4, 1), W("b", 2, 4, 1)]
    assert p.choose(item(), ws).worker_id == "a"


def test_affinity_prefers_the_producers_node_then_rail_then_falls_back():
    p = AffinityLeastLoaded()
    near = W("near", 1, 4, 3, labels={"node": "n1", "rail": "0"})
    rail = W("rail", 2, 4, 0, labels={"node": "n2", "rail": "0"})
    far = W("far", 3, 4, 0, labels={"node": "n3", "rail": "1"})
    hint = {"node": "n1", "rail": "0"}
    assert p.choose(item(**hint), [far, rail, near]).worker_id == "near"  # though busier
    assert p.choose(item(**hint), [far, rail]).worker_id == "rail"
    assert p.choose(item(**hint), [far]).worker_id == "far"  # never waits for affinity
    assert p.choose(item(), [near, rail, far]).worker_id == "rail"  # no hint: least loaded
    only_node = AffinityLeastLoaded(keys=("node",))
    assert only_node.choose(item(**hint), [far, rail]).worker_id == "rail"  # tie: least loaded
    assert p.score(hint, near.labels) > p.score(hint, rail.labels) > p.score(hint, far.labels)
    with pytest.raises(OrchestratorConfigError):
        AffinityLeastLoaded(keys="node")


def test_affinity_in_the_core_places_decode_on_the_denoise_node():
    h = Harness(policy=create_policy("affinity"))
    h.worker("dec-a", "decode", 2, node="n0")
    h.worker("dec-b", "decode", 2, node="n1")
    h.worker("den-1", "denoise", 1, node="n1")
    h.worker("den-0", "denoise", 1, node="n0")
    jobs = [one(h.feed(Submit(r, cached_embeddings=b"e")), Dispatch) for r in ("x", "y")]
    assert [j.worker_id for j in jobs] == ["den-1", "den-0"]
    for job in jobs:
        dec = one(h.finish(job), Dispatch)
        assert dec.worker_id == {"den-1": "dec-b", "den-0": "dec-a"}[job.worker_id]
        assert dec.item.hint == {"node": "n" + job.worker_id[-1]}  # the producer's labels
    # dec-b (n1) has no free credit: a latent from n1 falls back to dec-a
    h.feed(Heartbeat("dec-b", credits=1))
    z = one(h.feed(Submit("z", cached_embeddings=b"e")), Dispatch)
    assert z.worker_id == "den-1"
    assert one(h.finish(z), Dispatch).worker_id == "dec-a"


# ----------------------------------------------------------------------------- registry
def test_builtins_are_known_and_construct_by_name():
    assert {"round_robin", "least_loaded", "affinity"} <= set(known_policies())
    assert load_policy("round_robin") is RoundRobin
    assert isinstance(create_policy("least_loaded"), LeastLoaded)
    aff = create_policy("affinity", keys=("node",))
    assert isinstance(aff, AffinityLeastLoaded) and aff.keys == ("node",)
    assert isinstance(aff, RoutingPolicy)


def test_unknown_name_raises_listing_the_known_ones():
    with pytest.raises(OrchestratorConfigError) as e:
        load_policy("fastest")
    msg = str(e.value)
    assert "'fastest'" in msg and "affinity, least_loaded, round_robin" in msg


def test_duplicates_and_bad_targets_raise():
    reg = PolicyRegistry(entry_points=list)
    with pytest.raises(OrchestratorConfigError, match="already registered"):
        reg.register("affinity", "x.y:Z")
    with pytest.raises(OrchestratorConfigError, match="module:Class"):
        reg.register("mine", "no_colon")
    with pytest.raises(OrchestratorConfigError, match="already registered"):
        register_policy("round_robin", "mooncake_diffusion.orchestrator.core.policies:RoundRobin")
    reg.register("mine", "mooncake_diffusion.orchestrator.core.policies:LeastLoaded")
    with pytest.raises(OrchestratorConfigError, match="already registered"):
        reg.register("mine", "mooncake_diffusion.orchestrator.core.policies:LeastLoaded")


def test_options_are_passed_through_never_dropped():
    with pytest.raises(OrchestratorConfigError, match="rejects options"):
        create_policy("round_robin", keys=("node",))


def test_lookup_is_lazy_and_import_errors_are_config_errors():
    reg = PolicyRegistry(entry_points=list)
    reg.register("later", "mcd_not_a_real_module_xyz:Policy")
    assert "later" in reg.known()  # listed without importing anything
    assert "mcd_not_a_real_module_xyz" not in sys.modules
    with pytest.raises(OrchestratorConfigError, match="cannot import"):
        reg.load("later")
    reg.register("notapolicy", "mooncake_diffusion.orchestrator.core.model:STAGES")
    with pytest.raises(OrchestratorConfigError, match="choose"):
        reg.load("notapolicy")


def ep(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)


def test_entry_points_are_discovered_once_and_strictly():
    calls = []

    def eps():
        calls.append(1)
        return [
            ep("from_plugin", "mooncake_diffusion.orchestrator.core.policies:RoundRobin"),
            ep("affinity", "mooncake_diffusion.orchestrator.core.policies:AffinityLeastLoaded"),
        ]

    reg = PolicyRegistry(entry_points=eps)
    assert calls == []  # nothing read at construction
    assert isinstance(reg.create("from_plugin"), RoundRobin)
    assert "from_plugin" in reg.known() and calls == [1]
    with pytest.raises(OrchestratorConfigError, match="already registered"):
        reg.register("from_plugin", "a.b:C")

    clash = PolicyRegistry(entry_points=lambda: [ep("affinity", "other.pkg:Affinity")])
    with pytest.raises(OrchestratorConfigError, match="registered twice"):
        clash.known()


def test_this_package_declares_its_policies_as_entry_points():
    found = {e.name: e.value for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert found["affinity"] == "mooncake_diffusion.orchestrator.core.policies:AffinityLeastLoaded"
    assert found["round_robin"] == "mooncake_diffusion.orchestrator.core.policies:RoundRobin"
    assert found["least_loaded"] == "mooncake_diffusion.orchestrator.core.policies:LeastLoaded"

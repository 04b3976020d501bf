"""The orchestrator group on etcd under faults, on network-namespace hosts with a real
three-member etcd (``ha_deploy``, ``ha_scenarios``): the leader's host killed and cut
off, the leader cut off etcd alone, the etcd member under it killed. Each with work
in flight: none lost, none completed twice (by status and by the journal), every
output bitwise equal to the colocated run, no action of a deposed leader acted on,
nothing left in the store. Takeover times are reported (``bench/chaos.py``), not
asserted here."""

from __future__ import annotations

import pytest
from ha_deploy import HA_HOSTS, HEARTBEAT_S, EtcdHosts, HaDeployment
from ha_scenarios import HA_SCENARIOS, HaOutcome
from hosts import available
from master_scenario import scenario_master_leader_kill
from scenarios import running, settle
from spill_scenario import scenario_spill_burst

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    why = available()
    if why is not None:
        pytest.skip(f"chaos tier not run: {why}")
    work = tmp_path_factory.mktemp("chaos-ha")
    net = EtcdHosts(HA_HOSTS, str(work))
    with running(net, HaDeployment(net, work, heartbeat_timeout=HEARTBEAT_S)) as d:
        yield d


def _check(o: HaOutcome) -> None:
    assert o.lost == 0, o
    assert o.duplicates == 0, o
    assert o.completed == o.accepted, o
    assert o.fenced_actions == 0, o
    assert o.failover_s is not None, o
    if o.detect_s is not None:
        assert o.detect_s <= 2 * HEARTBEAT_S, o
    assert o.leaked_keys == 0, o
    assert o.leaked_fds == 0 and o.leaked_threads == 0, (o.left_by_host, o.fds_by_host)


@pytest.mark.parametrize("fn", HA_SCENARIOS, ids=[f.__name__[9:] for f in HA_SCENARIOS])
def test_ha_scenario(ha, fn):
    try:
        o = fn(ha)
    except BaseException:
        ha.release_all()
        settle(ha, list(ha.requests), timeout=120.0)
        raise
    _check(o)


def test_spill_burst(ha):
    """A soft-pinned burst 4x a spilling store host's pool, from another namespace
    host: every object put and read back intact, nothing left in the store."""
    o = scenario_spill_burst(ha)
    assert o.exit_codes.get("client") == 0, o
    assert o.put == o.objects and o.intact == o.objects, o
    assert o.leaked_keys == 0, o


def test_master_leader_kill(ha):
    """The Mooncake master leader SIGKILLed with a store request held between its put
    and its get: a standby on another host takes over, the request completes, nothing
    is left in the store."""
    o = scenario_master_leader_kill(ha)
    assert o.failover_s is not None, o
    assert o.completed, o
    assert o.took_over and o.took_over != o.killed, o
    assert o.leaked_keys == 0, o

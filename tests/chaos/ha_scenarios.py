"""Chaos scenarios of the orchestrator group on etcd (``ha_deploy``): the leader's host
killed or cut off, the leader cut off etcd alone (alive, reachable, without its
lease), the etcd member under the leader (made etcd's Raft leader) killed.

Each holds requests where the fault must land (one mid-denoise, one inside decode),
lands the fault, then submits a probe request held before its encode: the probe's
encode starting on a worker is the new leader dispatching (``failover_s`` = from the
fault to then, on the workers' clock: one kernel, one clock). Then it accounts, as
``scenarios.account`` does (none lost, none completed twice, outputs bitwise equal to
the colocated run, nothing left in the store), and checks the journal in etcd against
what the workers ran: ``fenced_actions`` counts items a worker started that no
committed dispatch asked for (a deposed leader's action that took effect), and a
request completed twice in the journal counts in ``duplicates``.

Orchestrator and etcd processes change roles (a standby leads with more threads):
they are not compared with their baselines; workers, store host and master are.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from deploy import TOKEN
from ha_deploy import ETCD_HOSTS, ORCHS, PREFIX, UNDER, HaDeployment, wait_line
from scenarios import Outcome, Run, colocated

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.ha.service import audit
from mooncake_diffusion.orchestrator.http.client import OrchestratorClient
from mooncake_diffusion.platform.etcd import EtcdClient, EtcdUnavailableError


@dataclass
class HaOutcome(Outcome):
    """``Outcome`` plus: ``failover_s`` (fault to the first dispatch after it running on
    a worker), ``announced_s``, ``failover_of`` (``orchestrator`` or ``etcd``), ``fenced_actions``,
    ``lease_s``."""

    failover_s: float | None = None
    #: fault to a leader (the new one, where one must take over) announced in etcd
    announced_s: float | None = None
    failover_of: str = "orchestrator"
    fenced_actions: int = 0
    lease_s: int = 0


class HaRun(Run):
    def __init__(self, d: HaDeployment, name: str) -> None:
        super().__init__(d, name)
        self.d: HaDeployment = d
        for h in (*ORCHS, *(f"etcd-{h}" for h in ETCD_HOSTS)):
            self.base.pop(h, None)  # roles change: not compared (module docstring)

    def prepare_probe(self) -> None:
        """Before the fault: the probe's params, gate and ground truth (so that after
        the fault submitting it costs only the submission)."""
        rid = f"{self.prefix}-probe"
        self.d.gate.hold(rid, "encode", 0)
        p = {"prompt": f"chaos {rid}", "seed": len(self.rids) + 1, "steps": 4, "guidance": 1.0}
        self.expected[rid] = colocated(p)
        self._probe = (rid, p)

    def probe(self, fault_t: float, old: str | None) -> tuple[str, float, float]:
        """Wait until a leader other than ``old`` (None: any) is announced, submit the
        probe to it at once, wait until the probe's encode starts: (its id, seconds
        from ``fault_t`` to the announcement, and to the encode). The leader-following
        client finds the new leader on its own (every later call of the scenario goes
        through it); the probe measures the standby, not that client's discovery."""
        ann = self.d.wait_leader(other_than=old)
        announced = time.time() - fault_t
        rid, p = self._probe
        with OrchestratorClient(ann.api, token=TOKEN, timeout=60) as direct:
            direct.submit(p, request_id=rid)
        self.d.requests.append(rid)
        self.rids.append(rid)
        return rid, announced, self.d.reached(rid, "encode") - fault_t

    def finish_ha(
        self, fault_t: float, probe: tuple[str, float, float], notes: str, of: str
    ) -> HaOutcome:
        _, announced, failover = probe
        o = HaOutcome(self.name, notes=notes, failover_s=round(failover, 3), failover_of=of)
        o.announced_s = round(announced, 3)
        o.lease_s = self.d.lease_s
        self.finish(fault_t, notes, outcome=o)
        seen = audit(self.d.etcd_endpoints(), PREFIX)
        ran = [x for x in self.d.gate.ran() if x[0] in self.rids]
        fenced = [x for x in ran if x[:3] not in seen.dispatched]
        o.fenced_actions += len(fenced)
        o.reasons += [f"{x[0]}: ran {x[1]} attempt {x[2]}, never dispatched" for x in fenced]
        twice = {r: n for r, n in seen.completions.items() if r in self.rids and n > 1}
        o.duplicates += sum(n - 1 for n in twice.values())
        o.reasons += [f"{r}: completed {n} times in the journal" for r, n in twice.items()]
        return o


def _in_flight(r: HaRun) -> tuple[str, str]:
    """One request held mid-denoise, one held inside decode."""
    a = r.submit("a", {"denoise": 1}, steps=3)
    b = r.submit("b", {"decode": 0}, frames=5, chunks=2)
    r.d.reached(a, "denoise")
    r.d.reached(b, "decode")
    r.prepare_probe()
    return a, b


def _release(r: HaRun, a: str, b: str, probe: str) -> None:
    r.d.release(a, "denoise")
    r.d.release(b, "decode")
    r.d.release(probe, "encode")


def scenario_orch_leader_kill(d: HaDeployment) -> HaOutcome:
    """The leader's host dies (its orchestrator SIGKILLed) with a request mid-denoise
    and one inside decode. The standby takes over; both complete once, and so does a
    request submitted after the fault. The host then comes back and stands by."""
    r = HaRun(d, "orch-kill")
    a, b = _in_flight(r)
    leader = d.leader().name
    fault_t = time.time()
    d.kill_host(leader)
    probe = r.probe(fault_t, leader)
    now = d.leader().name
    _release(r, a, b, probe[0])
    d.revive_host(leader)
    return r.finish_ha(fault_t, probe, f"killed host {leader}; {now} took over", "orchestrator")


def scenario_orch_leader_partition(d: HaDeployment) -> HaOutcome:
    """The leader's host is cut off (both networks) with work in flight. The standby
    takes over; the old leader, alive behind the partition, loses its lease and stops
    (it says ``deposed``); healed, it stands by and nothing it sent is acted on."""
    r = HaRun(d, "orch-partition")
    a, b = _in_flight(r)
    leader = d.leader().name
    old = d.procs[leader]
    mark = len(old.output())
    fault_t = time.time()
    d.net.partition(leader)
    probe = r.probe(fault_t, leader)
    now = d.leader().name
    _release(r, a, b, probe[0])
    wait_line(old, "orchestrator deposed", mark)
    d.net.heal(leader)
    wait_line(old, "orchestrator standby", mark)
    notes = f"partitioned {leader}; {now} took over; {leader} deposed"
    return r.finish_ha(fault_t, probe, notes, "orchestrator")


def scenario_orch_leader_etcd_cut(d: HaDeployment) -> HaOutcome:
    """The leader is cut off etcd only: alive, reachable by workers and clients, without
    its lease. A client pinned to it submits right after the cut: the old leader must
    not accept what it cannot commit, and nothing it sends may be acted on. The
    standby takes over; healed, the old leader stands by."""
    r = HaRun(d, "orch-etcd-cut")
    a, b = _in_flight(r)
    ann = d.leader()
    old = d.procs[ann.name]
    mark = len(old.output())
    pinned = OrchestratorClient(ann.api, token=TOKEN, timeout=60)
    z = f"{r.prefix}-pinned"
    answer: list[str] = []

    def submit_pinned() -> None:
        try:
            pinned.submit({"prompt": f"chaos {z}", "seed": 99, "steps": 4}, request_id=z)
            answer.append("accepted")
        except OrchestratorError as e:
            answer.append(f"refused: {type(e).__name__}")

    fault_t = time.time()
    d.net.cut_etcd(ann.name)
    t = threading.Thread(target=submit_pinned)
    t.start()
    probe = r.probe(fault_t, ann.name)
    now = d.leader().name
    _release(r, a, b, probe[0])
    t.join(120)
    pinned.close()
    wait_line(old, "orchestrator deposed", mark)
    d.net.heal_etcd(ann.name)
    wait_line(old, "orchestrator standby", mark)
    o = r.finish_ha(
        fault_t,
        probe,
        f"{ann.name} cut off etcd; {now} took over; pinned submit {answer[:1]}",
        "orchestrator",
    )
    seen = audit(d.etcd_endpoints(), PREFIX)
    ran_z = [x for x in d.gate.ran() if x[0] == z]
    if answer[:1] == ["accepted"] and z not in seen.submitted:
        o.fenced_actions += 1  # acknowledged by a leader that could not commit it
        o.reasons.append(f"{z}: accepted by the deposed leader, not in the journal")
    stray = [x for x in ran_z if x[:3] not in seen.dispatched]
    o.fenced_actions += len(stray)
    if z in seen.submitted:  # committed before the cut took effect: it must finish
        r.rids.append(z)
        o.notes += " (the pinned submit was committed in time)"
    return o


def _transfer_raft_leadership(d: HaDeployment, to: str) -> bool:
    """Ask etcd's Raft leader to hand leadership to ``to``'s member (best effort)."""
    cur = d.etcd_leader()
    if cur is None or cur == to:
        return cur == to
    try:
        target = EtcdClient([f"{d.net.etcd_ip(to)}:2379"]).call("maintenance/status", {})
        member = (target.get("header") or {}).get("member_id")  # type: ignore[union-attr]
        EtcdClient([f"{d.net.etcd_ip(cur)}:2379"]).call(
            "maintenance/transfer-leadership", {"targetID": member}, timeout=5
        )
    except EtcdUnavailableError:
        return False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if d.etcd_leader() == to:
            return True
        time.sleep(0.1)
    return False


def scenario_etcd_member_kill(d: HaDeployment) -> HaOutcome:
    """The etcd member under the orchestrator leader (the one it talks to first, made
    etcd's Raft leader first where etcd lets us) is SIGKILLed with work in flight:
    etcd elects another Raft leader, the orchestrator retries its commits through the
    other members and goes on leading (its lease outlives the election) or its
    standby takes over. ``failover_s``: fault to the next dispatch. The member then
    rejoins on its data."""
    r = HaRun(d, "etcd-kill")
    a, b = _in_flight(r)
    leader = d.leader().name
    member = UNDER[leader]
    raft = _transfer_raft_leadership(d, member)
    fault_t = time.time()
    d.kill_host(member)
    probe = r.probe(fault_t, None)
    now = d.leader().name
    _release(r, a, b, probe[0])
    d.revive_host(member)
    return r.finish_ha(
        fault_t,
        probe,
        f"killed {member}, the etcd member under {leader} "
        f"({'Raft leader' if raft else 'not Raft leader'}); orchestrator leader now {now}",
        "etcd",
    )


HA_SCENARIOS = [
    scenario_orch_leader_kill,
    scenario_orch_leader_partition,
    scenario_orch_leader_etcd_cut,
    scenario_etcd_member_kill,
]

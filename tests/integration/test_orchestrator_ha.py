"""The orchestrator group on a real etcd (``orchestrator --etcd``, ``ha/service.py``):
two orchestrator processes, StageWorkers and a client that follow the leader through
etcd (``etcd://...``).

- The leader is SIGKILLed with a request held inside denoise and another queued
  behind it: the standby takes over by replaying the journal, both complete, each
  exactly once (the journal's own replay says so), and the workers ran nothing the
  journal does not hold.
- The leader is SIGSTOPped past its lease (alive, without it, as behind a
  partition): the standby leads; when the old one runs again it must not act: it
  commits nothing, sends nothing that a worker runs, and stands by again.

Takeover times are measured in ``bench/chaos.py`` (namespaced hosts), not here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mooncake_diffusion.orchestrator.core.model import Submit
from mooncake_diffusion.orchestrator.ha.election import Candidate
from mooncake_diffusion.orchestrator.ha.service import EtcdJournal, audit
from mooncake_diffusion.orchestrator.http.client import OrchestratorClient
from mooncake_diffusion.orchestrator.link.follow import LeaderAddress
from mooncake_diffusion.orchestrator.service.journal import JournalError
from mooncake_diffusion.orchestrator.worker import toy
from mooncake_diffusion.orchestrator.worker.runtime import StageWorker
from mooncake_diffusion.platform.etcd import EtcdCluster
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.testing import assert_no_leaks, thread_names
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.transports.memory import fabric_keys

pytestmark = pytest.mark.integration

PREFIX = "/t/orch"


class Orchestrator:
    """One ``mooncake-diffusion orchestrator --etcd`` process; its output in a file."""

    def __init__(self, tmp: Path, name: str, endpoints: list[str], heartbeat_s: float = 30) -> None:
        self.log = tmp / f"{name}.log"
        self._f = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.cli",
                "orchestrator",
                "--etcd",
                ",".join(endpoints),
                "--etcd-prefix",
                PREFIX,
                "--name",
                name,
                "--port",
                "0",
                "--worker-bind",
                "tcp://127.0.0.1:0",
                "--heartbeat-timeout",
                str(heartbeat_s),
            ],
            stdout=self._f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"{text!r} not seen:\n{self.output()}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._f.close()


class Group:
    """etcd, orchestrators ``a`` (leading first) and ``b``, toy workers that record
    what they ran, denoise held per request until released."""

    def __init__(self, tmp: Path, etcd: EtcdCluster) -> None:
        self.tmp = tmp
        self.endpoints = etcd.endpoints
        self.url = f"etcd://{','.join(self.endpoints)}{PREFIX}"
        self.orch: dict[str, Orchestrator] = {}
        self.ran: list[tuple[str, str, int]] = []
        self.held: dict[str, threading.Event] = {}
        self.reached: dict[str, threading.Event] = {}
        self.workers: list[StageWorker] = []
        self.connectors: list[DiffusionConnector] = []

    def start(self, name: str, text: str, heartbeat_s: float = 30) -> Orchestrator:
        o = Orchestrator(self.tmp, name, self.endpoints, heartbeat_s)
        self.orch[name] = o
        o.wait_for(text)
        return o

    def hold(self, rid: str) -> None:
        self.held[rid] = threading.Event()
        self.reached[rid] = threading.Event()

    def _stage(self, stage: str):
        fn = getattr(toy, stage)

        def run(item, ctx):
            self.ran.append((item.request_id, stage, item.attempt))
            if stage == "denoise" and item.request_id in self.held:
                self.reached[item.request_id].set()
                self.held[item.request_id].wait(60)
            return fn(item, ctx)

        return run

    def pipeline(self) -> None:
        for stage in ("encode", "denoise", "decode"):
            conn = DiffusionConnector(stage, "memory", MooncakeSettings())
            self.connectors.append(conn)
            w = StageWorker(stage, self._stage(stage), self.url, worker_id=stage, connector=conn)
            self.workers.append(w.start())

    def client(self) -> OrchestratorClient:
        return OrchestratorClient(self.url, timeout=30)

    def fenced_actions(self) -> list[tuple[str, str, int]]:
        """Items a worker ran that no committed dispatch asked for."""
        dispatched = audit(self.endpoints, PREFIX).dispatched
        return [r for r in self.ran if r not in dispatched]

    def close(self) -> None:
        for h in self.held.values():
            h.set()
        for w in self.workers:
            w.drain()
        for w in self.workers:
            w.join(20)
        for o in self.orch.values():
            o.stop()
        for c in self.connectors:
            c.close()


@pytest.fixture
def group(tmp_path):
    threads = thread_names()
    with EtcdCluster(1) as etcd:
        g = Group(tmp_path, etcd)
        try:
            yield g
        finally:
            g.close()
    assert EtcdCluster.live() == [], "etcd members left running"
    assert fabric_keys() == [], fabric_keys()
    assert_no_leaks(None, threads)


def _leader(g: Group):
    got = LeaderAddress(g.endpoints, PREFIX).wait(30)
    assert got is not None
    return got


def test_a_killed_leader_loses_no_request_and_completes_none_twice(group):
    a = group.start("a", "orchestrator leading")
    group.start("b", "orchestrator standby")
    group.pipeline()
    group.hold("r1")
    with group.client() as c:
        c.submit({"prompt": "one"}, request_id="r1")
        c.submit({"prompt": "two"}, request_id="r2")  # queued behind r1 (one credit)
        assert group.reached["r1"].wait(30)
        term = _leader(group).term
        a.proc.kill()  # with r1 inside denoise and r2 queued
        a.proc.wait()
        group.orch["b"].wait_for("orchestrator leading")
        assert _leader(group).term > term
        group.held["r1"].set()
        for rid in ("r1", "r2"):
            st = c.wait(rid, timeout=60)
            assert st["state"] == "completed", st
        r3 = c.submit({"prompt": "three"})  # the new leader takes new work
        assert c.wait(r3, timeout=60)["state"] == "completed"
    seen = audit(group.endpoints, PREFIX)
    assert seen.completions == {"r1": 1, "r2": 1, r3: 1}
    assert group.fenced_actions() == []


def test_a_leader_without_its_lease_stops_acting_and_stands_by(group):
    a = group.start("a", "orchestrator leading")
    b = group.start("b", "orchestrator standby")
    group.pipeline()
    group.hold("r1")
    with group.client() as c:
        c.submit({"prompt": "one"}, request_id="r1")
        assert group.reached["r1"].wait(30)
        os.kill(a.proc.pid, signal.SIGSTOP)  # alive, renewing nothing: its lease lapses
        b.wait_for("orchestrator leading")
        group.held["r1"].set()  # the item ends while the old leader sleeps
        assert c.wait("r1", timeout=60)["state"] == "completed"
        os.kill(a.proc.pid, signal.SIGCONT)  # it wakes with frames queued for it
        a.wait_for("orchestrator deposed")
        r2 = c.submit({"prompt": "two"})
        assert c.wait(r2, timeout=60)["state"] == "completed"
    assert "orchestrator leading" in b.output()
    seen = audit(group.endpoints, PREFIX)
    assert seen.completions == {"r1": 1, r2: 1}
    assert group.fenced_actions() == []


def test_a_late_takeover_gives_up_on_no_worker(group):
    """The standby starts only after the workers' last journaled heartbeats are older
    than the heartbeat timeout: the takeover itself must not count as their silence
    (the new leader resumes the journal's time), so no worker is removed and the
    request held across it completes on its first attempt."""
    a = group.start("a", "orchestrator leading", heartbeat_s=1.0)
    group.pipeline()
    group.hold("r1")
    with group.client() as c:
        c.submit({"prompt": "one"}, request_id="r1")
        assert group.reached["r1"].wait(30)
        a.proc.kill()
        a.proc.wait()
        time.sleep(3.0)  # three heartbeat timeouts with no leader
        group.start("b", "orchestrator leading", heartbeat_s=1.0)
        group.held["r1"].set()
        assert c.wait("r1", timeout=60)["state"] == "completed"
    seen = audit(group.endpoints, PREFIX)
    assert seen.removed == []
    assert seen.completions == {"r1": 1}
    assert sorted(r[:3] for r in group.ran if r[0] == "r1") == [
        ("r1", "decode", 1),
        ("r1", "denoise", 1),
        ("r1", "encode", 1),
    ]


def test_the_etcd_journal_commits_a_group_in_chunks_a_standby_replays_in_order(tmp_path):
    threads = thread_names()
    with EtcdCluster(1) as etcd:
        client = etcd.client()
        leader = Candidate(client, PREFIX, "a", ttl_s=2)
        leader.campaign(timeout=30)
        journal = EtcdJournal(leader, chunk_bytes=200)
        events = [Submit(f"r{i}", None, b"x" * 50) for i in range(10)]
        journal.begin()
        for i, ev in enumerate(events):
            journal.append(float(i), journal.encode(ev)[1])
        journal.commit()
        assert journal.commits > 1  # the group went out as several guarded transactions
        standby = EtcdJournal(Candidate(client, PREFIX, "b", ttl_s=2))
        assert [(now, ev) for _, now, ev in standby.replay()] == [
            (float(i), ev) for i, ev in enumerate(events)
        ]
        leader.resign()  # deposed: nothing more is committed, and it says so
        journal.begin()
        journal.append(11.0, journal.encode(events[0])[1])
        with pytest.raises(JournalError, match="not committed"):
            journal.commit()
        assert standby.follow() == 0
    assert_no_leaks(None, threads)

"""Master HA: how long a Mooncake master failover takes and what it keeps, on real etcd.

    python bench/ha.py --quick --json /tmp/ha.json

Per row: a real etcd, two ``mooncake_master -enable_ha`` (with and without
``-enable_oplog``, side by side in one run), a store host and a pure ``StoreClient``
given ``etcd://...`` as master, all separate processes on loopback. The client
stores ``--objects`` hard-pinned 1 MiB objects (with the OpLog on, the kill waits
until etcd holds their entries, which the leader writes in the background:
``oplog_wait_s``), the leading master is SIGKILLed, and the bench measures
``leader_s`` (kill to a standby serving as leader), ``failover_s`` (kill to the same
client's first successful put: what a caller waits) and how many of the objects the
new leader still serves (``kept``). Then ``etcd_write_s``: a three-member etcd whose
Raft leader is SIGKILLed, kill to the next accepted write. And the orchestrator
election (``orchestrator/ha/election.py``, lease ``ORCH_TTL_S``): the leader stops
renewing, ``orchestrator_failover_s`` is its last renewal to the standby leading,
and ``fenced_actions`` counts the deposed leader's journal appends that went through
afterwards (3 tried). And spill: bursts of soft-pinned 8 MiB objects 2x, 4x and 8x a
64 MiB pool, the store host spilling to disk (``_mooncake/spill.py``) or not;
``intact`` counts objects read back whole. ``--quick`` runs the same rows, the
failover and election ones once each instead of three times.
Summary: master_failover_s (median, OpLog on), master_failover_s_no_oplog,
objects_kept_oplog / objects_kept_no_oplog (of ``--objects``), etcd_write_s,
orchestrator_failover_s (median) against orchestrator_lease_s, fenced_actions,
spill_burst_completed (objects of the largest burst that read back whole with
spill; spill_burst_completed_without_spill the same without),
leaked_keys (store keys left after each row's clean-up), mooncake_lease_s (the
master's etcd lease, Mooncake's constant) and mooncake_warmup_s (measured here:
start to serving of a lone HA master).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion._mooncake.master_view import oplog_puts
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import StoreFullError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.orchestrator.ha.election import Candidate
from mooncake_diffusion.platform.etcd import EtcdCluster
from mooncake_diffusion.platform.settings import MooncakeSettings

MIB = 1 << 20
#: Mooncake 0.3.13's master-view lease in etcd (its source and HA docs; not a flag)
MOONCAKE_LEASE_S = 5.0
#: spill bursts, in multiples of the 64 MiB pool (the same in --quick)
SPILL_MULTIPLES = (2, 4, 8)
#: the orchestrator election's lease (etcd 3.4 rounds shorter ones up to 2 s)
ORCH_TTL_S = 2


def _until(ok: Any, limit_s: float) -> float:
    """Seconds until ``ok()`` is true (polled every 50 ms); raises past ``limit_s``."""
    start = time.monotonic()
    while not ok():
        if time.monotonic() - start > limit_s:
            raise TimeoutError(f"not within {limit_s:.0f}s")
        time.sleep(0.05)
    return time.monotonic() - start


@contextlib.contextmanager
def _client(settings: MooncakeSettings, nbytes: int) -> Iterator[tuple[StoreClient, torch.Tensor]]:
    """A pure store client with a registered zeroed buffer of ``nbytes``; closed after."""
    client = StoreClient(settings)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    client.regs.pin(describe("b", buf)[1])
    try:
        yield client, buf
    finally:
        client.regs.unpin(describe("b", buf)[1])
        client.close()


def failover_row(etcd: EtcdCluster, oplog: bool, objects: int, run: int) -> dict[str, Any]:
    """One master failover with ``objects`` stored (see the module docstring)."""
    os.environ["MC_STORE_CLUSTER_ID"] = f"mcd_bench_{int(oplog)}_{run}_{time.monotonic_ns()}"
    started = time.monotonic()
    with LocalCluster(64 * MIB, masters=2, etcd_endpoints=etcd.endpoints, oplog=oplog) as c:
        warmup_s = time.monotonic() - started
        assert c.masters is not None and c.settings is not None
        with _client(c.settings, objects * MIB) as (client, buf):
            buf.copy_(torch.arange(objects * MIB, dtype=torch.int64).to(torch.uint8))
            keys = [f"bench-{i}" for i in range(objects)]
            ptrs = [[buf.data_ptr() + i * MIB] for i in range(objects)]
            sizes = [[MIB]] * objects
            client.put_many(keys, ptrs, sizes, pin="hard")
            oplog_wait_s = 0.0
            if oplog:
                oplog_wait_s = _until(lambda: set(keys) <= oplog_puts(c.settings.master), 120)
            c.masters.kill_leader()
            killed = time.monotonic()
            leader_s = _until(lambda: c.masters.leader() is not None, 120.0)

            def put() -> bool:
                try:
                    client.put_many(["bench-after"], [ptrs[0]], [sizes[0]], pin="hard")
                    return True
                except StoreFullError:  # the store host has not re-mounted yet
                    return False

            _until(put, 120.0)
            failover_s = time.monotonic() - killed
            kept = sum(client.get_many(keys, ptrs, sizes))
            if oplog and kept < objects:  # restored replicas wait for their owner's remount
                time.sleep(MOONCAKE_LEASE_S)
                kept = sum(client.get_many(keys, ptrs, sizes))
            client.remove_many(["bench-after", *keys])
            leaked = len(c.keys())
    return {
        "part": "master failover",
        "oplog": oplog,
        "objects": objects,
        "start_s": round(warmup_s, 3),
        "oplog_wait_s": round(oplog_wait_s, 3),
        "leader_s": round(leader_s, 3),
        "failover_s": round(failover_s, 3),
        "kept": kept,
        "leaked_keys": leaked,
    }


def etcd_row() -> dict[str, Any]:
    """Three etcd members, the Raft leader SIGKILLed: seconds to the next write."""
    with EtcdCluster(3) as etcd:
        etcd.kill(etcd.leader())
        start = time.monotonic()
        etcd.wait_ready(60.0)
        return {"part": "etcd leader kill", "etcd_write_s": round(time.monotonic() - start, 3)}


def orchestrator_row(etcd: EtcdCluster, run: int) -> dict[str, Any]:
    """The orchestrator election: the leader stops renewing at t0 (its host cut off),
    the standby campaigns (polling every 50 ms); then the old leader tries to append."""
    prefix = f"/bench/orch/{run}/{time.monotonic_ns()}"
    client = etcd.client()
    with (
        Candidate(client, prefix, "old", ttl_s=ORCH_TTL_S) as old,
        Candidate(client, prefix, "new", ttl_s=ORCH_TTL_S) as new,
    ):
        old.campaign(timeout=30)
        old.renew()
        cut = time.monotonic()  # old's last renewal: from here it is cut off
        new.campaign(timeout=120, poll_s=0.05)
        took = time.monotonic() - cut
        fenced = sum(old.append([f"late-{i}".encode()]) for i in range(3))
    return {
        "part": "orchestrator election",
        "lease_s": ORCH_TTL_S,
        "orchestrator_failover_s": round(took, 3),
        "fenced_actions": fenced,
    }


def spill_row(spill: bool, multiple: int) -> dict[str, Any]:
    """A burst of soft-pinned 8 MiB objects ``multiple`` times a 64 MiB pool, with the
    store host spilling to disk or not: how many were put, and read back intact."""
    pool, obj = 64 * MIB, 8 * MIB
    count = multiple * pool // obj
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(pool, spill_dir=os.path.join(tmp, "spill") if spill else None) as c,
    ):
        assert c.settings is not None
        with _client(c.settings, obj) as (client, buf):
            start = time.monotonic()
            stored = []
            for i in range(count):
                buf.fill_(i % 251)
                key = f"spill-{i}"

                def put(key: str = key) -> bool:
                    try:
                        client.put_many([key], [[buf.data_ptr()]], [[obj]], pin="soft")
                        return True
                    except StoreFullError:
                        return False

                try:
                    _until(put, 60.0)
                except TimeoutError:
                    break
                stored.append(key)
            put_s = time.monotonic() - start
            intact = 0
            for i, key in enumerate(stored):
                buf.zero_()
                ok = client.get_many([key], [[buf.data_ptr()]], [[obj]]) == [True]
                intact += ok and bool((buf == i % 251).all())
            client.remove_many(stored)
            leaked = len(c.keys())
    return {
        "part": "spill burst",
        "spill": spill,
        "burst_x_pool": multiple,
        "objects": count,
        "put": len(stored),
        "intact": intact,
        "put_s": round(put_s, 3),
        "leaked_keys": leaked,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="each row once (else 3 times)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="that it runs, not a measurement: --quick with the smallest spill burst only",
    )
    p.add_argument("--objects", type=int, default=8)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    repeats = 1 if a.quick or a.smoke else 3
    rows: list[dict[str, Any]] = []
    # one etcd for every master row: Mooncake's client keeps one etcd per process
    with EtcdCluster(1) as etcd:
        for run in range(repeats):
            for oplog in (True, False):
                rows.append(failover_row(etcd, oplog, a.objects, run))
                print(json.dumps(rows[-1]), flush=True)
            rows.append(orchestrator_row(etcd, run))
            print(json.dumps(rows[-1]), flush=True)
    for _ in range(repeats):
        rows.append(etcd_row())
        print(json.dumps(rows[-1]), flush=True)
    for multiple in SPILL_MULTIPLES[:1] if a.smoke else SPILL_MULTIPLES:
        for spill in (True, False):
            rows.append(spill_row(spill, multiple))
            print(json.dumps(rows[-1]), flush=True)

    def largest(spill: bool) -> int:
        """Objects of the largest burst that read back whole (0: none did)."""
        done = [
            r["objects"] for r in rows if r.get("spill") is spill and r["intact"] == r["objects"]
        ]
        return max(done, default=0)

    def med(key: str, oplog: bool | None = None) -> float:
        vals = [r[key] for r in rows if key in r and (oplog is None or r["oplog"] is oplog)]
        return statistics.median(vals)

    summary = {
        "master_failover_s": med("failover_s", True),
        "master_failover_s_no_oplog": med("failover_s", False),
        "objects_kept_oplog": min(r["kept"] for r in rows if r.get("oplog") is True),
        "objects_kept_no_oplog": max(r["kept"] for r in rows if r.get("oplog") is False),
        "objects": a.objects,
        "etcd_write_s": med("etcd_write_s"),
        "orchestrator_failover_s": med("orchestrator_failover_s"),
        "orchestrator_lease_s": ORCH_TTL_S,
        "fenced_actions": sum(r.get("fenced_actions", 0) for r in rows),
        "spill_burst_completed": largest(True),
        "spill_burst_completed_without_spill": largest(False),
        "leaked_keys": sum(r.get("leaked_keys", 0) for r in rows),
        "leaked_etcd_members": len(EtcdCluster.live()),
        "mooncake_lease_s": MOONCAKE_LEASE_S,
        "mooncake_warmup_s": med("start_s"),
    }
    print(json.dumps(summary))
    if a.json:
        doc = {
            "bench": "ha",
            "config": {
                "quick": a.quick,
                "smoke": a.smoke,
                "objects": a.objects,
                "repeats": repeats,
            },
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
            "rows": rows,
            "summary": summary,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

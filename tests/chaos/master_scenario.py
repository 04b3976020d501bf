"""The Mooncake master leader killed on namespace hosts, a store request held across it.

Runs beside the HA deployment (``ha_deploy``), on its real three-member etcd: two
``mooncake_master -enable_ha -enable_oplog`` on different hosts (``MASTER_HOSTS``,
ports ``HA_RPC`` / ``HA_ADMIN``, cluster ``CLUSTER_ID``), a store host on the
``store`` host and a client (``master_client.py``) on the ``enc`` host, both given
``etcd://`` over the three members as their master. The client puts its input and
holds (``HELD``) before reading it back; the scenario then SIGKILLs the serving
leader and writes the kill time into the client's gate. Outcome: ``failover_s``
(kill to a put and get through the store working again, on the client's clock:
one kernel), whether the held input survived (``kept``; else the client reruns its
put, as a stage whose input is gone is rerun), whether the held request completed,
and keys left on the new leader after the client removed its own.

The store host and the client are SIGKILLed at the end: closing a client of an HA
master takes about 30 s (``_mooncake/ha.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from deploy import HERE
from ha_deploy import HaDeployment

from mooncake_diffusion._mooncake import mooncake_dir

MASTER_HOSTS = ("master", "orch1")
HA_RPC, HA_ADMIN = 50071, 9023
CLUSTER_ID = "mcd_chaos_master_ha"
#: the hosts of the store host and the client
HOSTS_USED = ("store", "enc")


@dataclass
class MasterOutcome:
    name: str
    failover_s: float | None = None
    kept: bool | None = None
    rerun: bool | None = None
    completed: bool = False
    leaked_keys: int = 0
    killed: str = ""
    took_over: str = ""
    exit_codes: dict[str, int] = field(default_factory=dict)
    notes: str = ""

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _get(admin: str, path: str) -> bytes:
    with urllib.request.urlopen(f"http://{admin}{path}", timeout=1) as r:
        return r.read()


def _serving(admin: str) -> bool:
    try:
        h = json.loads(_get(admin, "/health"))
    except (OSError, ValueError):
        return False
    return h.get("role") == "leader" and bool(h.get("service_ready"))


def _wait(ok: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def scenario_master_leader_kill(d: HaDeployment) -> MasterOutcome:
    """The serving master leader SIGKILLed while a client holds a request between its
    put and its get: a standby on another host takes over, the request completes
    (read back, or rerun where the input is gone), nothing is left in the store."""
    net = d.net
    etcd = ";".join(d.etcd_endpoints())
    admins = {h: f"{net.ip(h)}:{HA_ADMIN}" for h in MASTER_HOSTS}
    o = MasterOutcome("master-kill")
    masters = {
        h: net.spawn(
            h,
            [
                os.path.join(mooncake_dir(), "mooncake_master"),
                f"-rpc_port={HA_RPC}",
                f"-rpc_address={net.ip(h)}",
                f"-metrics_port={HA_ADMIN}",
                f"-metrics_host={net.ip(h)}",
                "-default_kv_lease_ttl=1000",
                "-client_ttl=3",
                "-enable_ha=true",
                "-ha_backend_type=etcd",
                f"-etcd_endpoints={etcd}",
                f"-cluster_id={CLUSTER_ID}",
                "-enable_oplog=true",
            ],
        )
        for h in MASTER_HOSTS
    }
    env = {"MOONCAKE_MASTER": f"etcd://{etcd}", "MC_STORE_CLUSTER_ID": CLUSTER_ID}
    env_of = {h: {k: v for k, v in d.env(h).items() if k != "MOONCAKE_ADMIN"} for h in HOSTS_USED}
    gate = d.work / "master-kill.gate"
    store = client = None
    try:
        leader = _wait(
            lambda: next((h for h in MASTER_HOSTS if _serving(admins[h])), None),
            "no HA master leads",
        )
        store = net.spawn(
            "store",
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.transfer.store_host",
                f"--master=etcd://{etcd}",
                f"--host={net.ip('store')}",
                "--pool-bytes=67108864",
                "--reap-interval=0",
            ],
            {**env_of["store"], **env},
        )
        store.wait_for('"ready": true')
        client = net.spawn(
            "enc",
            [sys.executable, str(HERE / "master_client.py"), str(gate)],
            {**env_of["enc"], **env},
        )
        client.wait_for("HELD", timeout=120)
        o.killed = leader
        masters[leader].kill()
        gate.write_text(repr(time.time()))
        out = client.wait_for('"completed"', timeout=300)
        got = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
        o.failover_s, o.kept = got["failover_s"], got["kept"]
        o.rerun, o.completed = got["rerun"], got["completed"]
        o.took_over = _wait(
            lambda: next((h for h in MASTER_HOSTS if _serving(admins[h])), None),
            "no HA master took over",
        )
        keys = [k for k in _get(admins[o.took_over], "/get_all_keys").decode().splitlines() if k]
        o.leaked_keys = len(keys)
        o.notes = (
            f"killed the master leader on {leader}; {o.took_over} took over; held input "
            f"{'kept' if o.kept else 'gone, put rerun'}"
        )
    finally:
        for name, p in (("client", client), ("store", store)):
            if p is not None:
                p.kill()  # closing an HA client takes ~30 s (module docstring)
                o.exit_codes[name] = p.popen.returncode
        for h, p in masters.items():
            o.exit_codes[f"master-{h}"] = p.stop()
    return o


__all__ = ["MASTER_HOSTS", "MasterOutcome", "scenario_master_leader_kill"]

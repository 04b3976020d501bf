"""A spill burst on namespace hosts: a burst larger than a store host's DRAM pool
completes through Mooncake's offload to local disk (``_mooncake/spill.py``).

Runs beside the HA deployment (``ha_deploy``: its etcd members and orchestrators
stay up), on its own master and store host so that the deployment's pool and
baselines stay as they are: a second ``mooncake_master`` with ``SPILL_MASTER_FLAGS``
on the ``master`` host (ports ``SPILL_RPC`` / ``SPILL_ADMIN``), a store host with a
``SPILL_POOL`` pool and ``--spill-dir`` on the ``store`` host, and the burst
(``spill_burst.py``, ``SPILL_X`` times the pool in ``SPILL_OBJECT`` objects,
soft-pinned: what spill lets go to disk) from the ``enc`` host, over the namespace
network. Outcome: objects put and read back intact, keys left in that master after
the burst removed its objects, and the spill processes' exit codes.
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
from mooncake_diffusion._mooncake.spill import SPILL_MASTER_FLAGS

SPILL_RPC, SPILL_ADMIN = 50061, 9013
SPILL_POOL = 64 << 20
SPILL_OBJECT = 8 << 20
#: the burst, in multiples of the pool (the same in --quick)
SPILL_X = 4


@dataclass
class SpillOutcome:
    name: str
    objects: int
    put: int = 0
    intact: int = 0
    put_s: float | None = None
    get_s: float | None = None
    leaked_keys: int = 0
    burst_x_pool: int = SPILL_X
    pool_bytes: int = SPILL_POOL
    object_bytes: int = SPILL_OBJECT
    spilled_files: int = 0
    exit_codes: dict[str, int] = field(default_factory=dict)
    notes: str = ""

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _keys(admin: str) -> list[str]:
    with urllib.request.urlopen(f"http://{admin}/get_all_keys", timeout=2) as r:
        return [k for k in r.read().decode().splitlines() if k]


def scenario_spill_burst(d: HaDeployment) -> SpillOutcome:
    """A soft-pinned burst ``SPILL_X`` times the spilling store host's pool, from
    another host: every object is put and read back intact, none left behind."""
    net = d.net
    ip = net.ip("master")
    rpc, admin = f"{ip}:{SPILL_RPC}", f"{ip}:{SPILL_ADMIN}"
    spill_dir = d.work / "spill"
    spill_dir.mkdir(exist_ok=True)
    objects = SPILL_X * SPILL_POOL // SPILL_OBJECT
    o = SpillOutcome("spill-burst", objects)
    env = {"MOONCAKE_MASTER": rpc, "MOONCAKE_ADMIN": admin}
    master = net.spawn(
        "master",
        [
            os.path.join(mooncake_dir(), "mooncake_master"),
            f"-rpc_port={SPILL_RPC}",
            f"-rpc_address={ip}",
            f"-metrics_port={SPILL_ADMIN}",
            f"-metrics_host={ip}",
            "-default_kv_lease_ttl=1000",
            "-client_ttl=2",
            *SPILL_MASTER_FLAGS,
        ],
    )
    store = None
    try:
        deadline = time.monotonic() + 30
        while True:  # the master's admin answers once it serves
            try:
                _keys(admin)
                break
            except OSError:
                assert master.popen.poll() is None, master.output()[-2000:]
                assert time.monotonic() < deadline, master.output()[-2000:]
                time.sleep(0.05)
        store = net.spawn(
            "store",
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.transfer.store_host",
                f"--master={rpc}",
                f"--admin={admin}",
                f"--host={net.ip('store')}",
                f"--pool-bytes={SPILL_POOL}",
                "--reap-interval=0",
                f"--spill-dir={spill_dir}",
            ],
            {**d.env("store"), **env},
        )
        store.wait_for('"ready": true')
        client = net.spawn(
            "enc",
            [
                sys.executable,
                str(HERE / "spill_burst.py"),
                f"--objects={objects}",
                f"--object-bytes={SPILL_OBJECT}",
            ],
            {**d.env("enc"), **env},
        )
        rc = client.popen.wait(600)
        o.exit_codes["client"] = rc
        out = client.output()
        line = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
        assert line is not None, f"burst client (rc {rc}) said nothing:\n{out[-3000:]}"
        got = json.loads(line)
        o.put, o.intact = got["put"], got["intact"]
        o.put_s, o.get_s = got["put_s"], got["get_s"]
        o.spilled_files = sum(len(fs) for _, _, fs in os.walk(spill_dir))
        o.leaked_keys = len(_keys(admin))
        o.notes = f"{o.intact}/{objects} objects intact, {o.spilled_files} files on disk after"
    finally:
        if store is not None:
            o.exit_codes["store"] = store.stop()
        o.exit_codes["master"] = master.stop()
    return o


__all__ = ["SPILL_X", "SpillOutcome", "scenario_spill_burst"]

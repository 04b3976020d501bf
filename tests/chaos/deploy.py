"""The reference pipeline deployed across namespaced hosts, for the chaos scenarios.

Layout (one host each): ``master`` (mooncake_master), ``store`` (the store host),
``orch`` (the orchestrator, with a journal), ``enc`` (encode), ``den0``/``den1``
(denoise), ``dec0``/``dec1`` (decode). Workers run ``gated`` stage functions
(``tests/gated.py``: the reference pipeline, holding where a test asks). Every process reaches the
others over the bridge by the hosts' addresses; nothing uses loopback across
hosts, and the same-host copy path is off.

``Deployment.up()`` starts everything and waits until each worker is welcomed;
``down()`` stops the workers (SIGTERM: they drain), the orchestrator, store host
and master, and reports their exit codes. ``keys()`` lists store keys (the
leak check), ``requests`` records every accepted request id.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from gated import Gate
from hosts import Hosts, Spawned

from mooncake_diffusion._mooncake import mooncake_dir
from mooncake_diffusion.orchestrator.http.client import OrchestratorClient
from mooncake_diffusion.platform import bindshim

HOSTS = ("master", "store", "orch", "enc", "den0", "den1", "dec0", "dec1")
WORKERS = {
    "enc": "encode",
    "den0": "denoise",
    "den1": "denoise",
    "dec0": "decode",
    "dec1": "decode",
}
RPC, ADMIN, API, WPORT = 50051, 9003, 7421, 7422
TOKEN = "chaos-token"
#: heartbeat timeout of the chaos deployment (detection is bounded by 2x this)
HEARTBEAT_S = 3.0
HERE = Path(__file__).resolve().parent


class Deployment:
    def __init__(
        self,
        net: Hosts,
        work: Path,
        *,
        heartbeat_timeout: float = HEARTBEAT_S,
        pool_bytes: int = 256 << 20,
        transfer_mode: str = "store",
        max_attempts: int = 3,
    ) -> None:
        self.net = net
        self.work = work
        self.gate = Gate(work)
        self.heartbeat_timeout = heartbeat_timeout
        self.pool_bytes = pool_bytes
        self.transfer_mode = transfer_mode
        self.max_attempts = max_attempts
        self.procs: dict[str, Spawned] = {}
        self.client: OrchestratorClient | None = None
        self.requests: list[str] = []

    # ------------------------------------------------------------------ addresses
    @property
    def master(self) -> str:
        return f"{self.net.ip('master')}:{RPC}"

    @property
    def admin(self) -> str:
        return f"{self.net.ip('master')}:{ADMIN}"

    @property
    def orchestrator_address(self) -> str:
        """What workers are given as ``--orchestrator``."""
        return f"tcp://{self.net.ip('orch')}:{WPORT}"

    def env(self, host: str) -> dict[str, str]:
        return {
            "MOONCAKE_MASTER": self.master,
            "MOONCAKE_ADMIN": self.admin,
            "MOONCAKE_LOCAL_HOSTNAME": self.net.ip(host),
            # its Transfer Engine's listeners on this host's address only
            **bindshim.env(self.net.ip(host)),
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_DIFFUSION_SAME_HOST": "0",
            "MCD_ORCHESTRATOR_TOKEN": TOKEN,
            "MCD_CHECKPOINT_EVERY": "1",
            # a p2p producer silent this long is given up, as the orchestrator does
            "MOONCAKE_DIFFUSION_PEER_TIMEOUT_S": str(self.heartbeat_timeout),
            **self.gate.env(),
            "PYTHONPATH": os.pathsep.join(
                [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]
            ),
        }

    # ------------------------------------------------------------------ processes
    def start_master(self) -> Spawned:
        ip = self.net.ip("master")
        p = self.net.spawn(
            "master",
            [
                os.path.join(mooncake_dir(), "mooncake_master"),
                f"-rpc_port={RPC}",
                f"-rpc_address={ip}",
                f"-metrics_port={ADMIN}",
                f"-metrics_host={ip}",
                "-default_kv_lease_ttl=1000",
                "-client_ttl=2",
            ],
        )
        self.procs["master"] = p
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if json.loads(self._admin("/health")).get("service_ready"):
                    return p
            except (OSError, ValueError):
                pass
            if p.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"master did not come up:\n{p.output()[-2000:]}")

    def start_store(self, avoid: set[str] | None = None) -> Spawned:
        """Start the store host. ``avoid``: segment names (``ip:port``) a new store host
        must not take again: a restarted one then mounts under a name of its own, which
        the scenarios wait for (Mooncake draws the port at random, and a restart that
        drew its predecessor's, as CI's run of 2026-12-05 under load did, left them
        waiting for a name that never came; a store host back under its old name is
        covered by ``tests/integration/test_store_recycle.py``)."""
        env = self.env("store")
        ports = [int(name.rsplit(":", 1)[1]) for name in avoid or ()]
        if ports:
            port = str(max(ports) + 1)
            env = {**env, "MC_STORE_CLIENT_MIN_PORT": port, "MC_STORE_CLIENT_MAX_PORT": port}
        p = self.net.spawn(
            "store",
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.transfer.store_host",
                f"--master={self.master}",
                f"--admin={self.admin}",
                f"--host={self.net.ip('store')}",
                f"--pool-bytes={self.pool_bytes}",
                "--reap-interval=0.5",
            ],
            env,
        )
        p.wait_for('"ready": true')
        self.procs["store"] = p
        return p

    def start_orchestrator(self) -> Spawned:
        ip = self.net.ip("orch")
        p = self.net.spawn(
            "orch",
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.cli",
                "orchestrator",
                "--host",
                ip,
                "--port",
                str(API),
                "--worker-port",
                str(WPORT),
                "--journal",
                str(self.work / "orchestrator.db"),
                "--heartbeat-timeout",
                str(self.heartbeat_timeout),
                "--max-attempts",
                str(self.max_attempts),
            ],
            self.env("orch"),
        )
        p.wait_for("orchestrator ready")
        self.procs["orch"] = p
        if self.client is None:
            self.client = OrchestratorClient(f"http://{ip}:{API}", token=TOKEN)
        return p

    def start_worker(self, host: str, *, wait: bool = True) -> Spawned:
        stage = WORKERS[host]
        p = self.net.spawn(
            host,
            [
                sys.executable,
                "-m",
                "mooncake_diffusion.cli",
                "worker",
                "--stage",
                stage,
                "--fn",
                f"gated:{stage}",
                "--orchestrator",
                self.orchestrator_address,
                "--worker-id",
                host,
                "--transfer-mode",
                self.transfer_mode,
                "--label",
                f"node={host}",
            ],
            self.env(host),
        )
        self.procs[host] = p
        if wait:
            p.wait_for("worker ready", timeout=120)
        return p

    def up(self, workers: tuple[str, ...] = tuple(WORKERS)) -> Deployment:
        self.start_master()
        self.start_store()
        self.start_orchestrator()
        for h in workers:
            self.start_worker(h, wait=False)
        for h in workers:
            self.procs[h].wait_for("worker ready", timeout=120)
        return self

    def down(self) -> dict[str, int]:
        """Stop workers, orchestrator, store host and master in that order; exit codes."""
        rcs: dict[str, int] = {}
        for h in [h for h in self.procs if h in WORKERS]:
            rcs[h] = self.procs[h].stop()
        for h in ("orch", "store", "master"):
            if h in self.procs:
                rcs[h] = self.procs[h].stop()
        if self.client is not None:
            self.client.close()
        return rcs

    # ------------------------------------------------------------------ requests
    def submit(self, rid: str, hold: dict[str, int] | None = None, **params: Any) -> str:
        """Submit request ``rid``; ``hold`` maps a stage to where its first arrival
        holds (``Gate.hold``: a denoise step, 0 before its input is consumed; decode:
        latent chunks consumed; serve: chunks a p2p producer wrote)."""
        for stage, step in (hold or {}).items():
            self.gate.hold(rid, stage, step)
        p = {"prompt": f"chaos {rid}", "seed": len(self.requests), "steps": 4, **params}
        assert self.client is not None
        got = self.client.submit(p, request_id=rid)
        self.requests.append(got)
        return got

    def reached(self, rid: str, stage: str, timeout: float = 120.0) -> float:
        """Wait until ``rid``'s ``stage`` holds at its gate; the wall time it got there."""
        return float(self.gate.reached(rid, stage, timeout)["t"])

    def release(self, rid: str, stage: str) -> None:
        self.gate.release(rid, stage)

    def release_all(self) -> None:
        """Release every gate of every request submitted so far (a failed scenario must
        leave no work held for the scenarios after it)."""
        for rid in self.requests:
            for stage in ("encode", "denoise", "decode", "serve"):
                self.gate.release(rid, stage)

    def segments(self) -> list[str]:
        """The store segments the master lists (``host:port`` of each store host)."""
        return [k for k in self._admin("/get_all_segments").decode().splitlines() if k]

    def store_keys(self) -> list[str]:
        return [k for k in self._admin("/get_all_keys").decode().splitlines() if k]

    def _admin(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=2) as r:
            return r.read()

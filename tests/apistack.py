"""An in-process orchestrator stack for the HTTP API's tests (test_orchestrator_api.py,
test_front_door.py): real sockets on loopback, toy stages, no Mooncake."""

from __future__ import annotations

import http.client
import json
import os
import time
from typing import Any

from mooncake_diffusion.orchestrator import OrchestratorConfig
from mooncake_diffusion.orchestrator.http.api import ApiServer
from mooncake_diffusion.orchestrator.http.client import OrchestratorClient
from mooncake_diffusion.orchestrator.http.remote import RemoteService
from mooncake_diffusion.orchestrator.service.bridge import BridgeServer
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.orchestrator.worker import toy
from mooncake_diffusion.orchestrator.worker.runtime import StageWorker
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.transports.memory import fabric_keys


def raw(
    api: ApiServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers=None,
    timeout: float = 10.0,
):
    """One HTTP request on a fresh connection: (status, the JSON body or {})."""
    conn = http.client.HTTPConnection(api.host, api.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


class Stack:
    """A started service and its HTTP API on loopback, with StageWorkers (toy stages
    by default) over the in-memory transport. ``api``: more ``ApiServer`` arguments
    (``outputs``, ``body_timeout_s``, ``front``, ``limits``); ``planner``: the
    service's planner instance (default static); ``cfg``: ``OrchestratorConfig``
    fields; ``bridged``: the API serves a ``remote.RemoteService`` over a real
    ``BridgeServer`` (what ``--front-process`` runs in its child, in this process).
    ``close()`` checks every publication was released."""

    def __init__(
        self,
        token: str | None = None,
        api: dict[str, Any] | None = None,
        planner: Any = None,
        bridged: bool = False,
        **cfg: object,
    ) -> None:
        config = ServiceConfig(
            orchestrator=OrchestratorConfig(**cfg),  # type: ignore[arg-type]
            worker_bind="tcp://127.0.0.1:0",
            token=token,
        )
        #: payloads in the fabric before this stack (an earlier test's leak, reported there)
        self.held = set(fabric_keys())
        self.svc = OrchestratorService(config, planner=planner).start()
        self.bridge = BridgeServer(self.svc).start() if bridged else None
        self.remote = RemoteService(self.bridge.path) if self.bridge else None
        served: Any = self.remote or self.svc
        self.api = ApiServer(served, "127.0.0.1", 0, token=token, **(api or {}))
        self.client = OrchestratorClient(self.api.url, token=token)
        self.workers: list[StageWorker] = []
        self.connectors: list[DiffusionConnector] = []
        self.token = token

    def worker(self, stage: str, fn=None, **kw) -> StageWorker:
        conn = DiffusionConnector(stage, "memory", MooncakeSettings())
        self.connectors.append(conn)
        w = StageWorker(
            stage,
            fn or getattr(toy, stage),
            self.svc.worker_address,
            connector=conn,
            token=self.token,
            **kw,
        ).start()
        self.workers.append(w)
        return w

    def pipeline(self) -> None:
        for stage in ("encode", "denoise", "decode"):
            self.worker(stage)

    def close(self) -> None:
        self.client.close()
        for w in self.workers:
            w.drain()
        for w in self.workers:
            w.join(10)
        self.svc.close()
        self.api.close()
        if self.remote is not None and self.bridge is not None:
            self.remote.close()
            self.bridge.close()
            assert not os.path.exists(os.path.dirname(self.bridge.path)), "its folder is left"
        for c in self.connectors:
            assert c.stats().live_publications == 0, c.stats()
            c.close()

    def close_released(self) -> None:
        """``close()``, once every payload is released (a release follows a request's
        outcome, which the client may hear of first); fails if one never is."""
        deadline = time.monotonic() + 10
        while set(fabric_keys()) - self.held and time.monotonic() < deadline:
            time.sleep(0.02)
        self.close()
        left = sorted(set(fabric_keys()) - self.held)
        assert left == [], left  # every payload released

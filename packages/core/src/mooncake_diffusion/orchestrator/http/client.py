"""A client of the orchestrator's HTTP API, with the library-mode service's method names.

    client = OrchestratorClient("http://127.0.0.1:7421", token=None)
    rid = client.submit({"prompt": "a cat"}, slo_class="interactive")
    for ev in client.events(rid): ...           # dicts, one per RequestEvent
    st = client.wait(rid, timeout=60)           # the final status (a dict)
    client.cancel(rid); client.status(rid); client.cluster(); client.metrics_text()

``OrchestratorClient("etcd://HOST:PORT[,...][/PREFIX]")`` follows the leader of an
orchestrator group on etcd (``link/follow.py``): a call that finds no service (the leader
died or was deposed) looks the leader up again and is resent there until ``timeout``;
a resent ``submit`` that the old leader had accepted answers ``duplicate_request``
there, which means accepted: it returns the id. Each try then waits at most
``FOLLOW_TRY_S`` for an answer (a stopped or cut-off leader answers nothing).

One keep-alive connection, not thread-safe (one client per thread). Errors:
``RequestRejected`` with the API's error code for 4xx answers,
``ServiceUnavailable`` when the service cannot be reached or answers 5xx.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from mooncake_diffusion.orchestrator.link.follow import ETCD_SCHEME, LeaderAddress
from mooncake_diffusion.orchestrator.service.service import RequestRejected, ServiceUnavailable

__all__ = ["OrchestratorClient"]

_TERMINAL = ("completed", "failed", "cancelled")
#: the longest one HTTP try waits when following a leader (then the leader is looked up)
FOLLOW_TRY_S = 3.0


class OrchestratorClient:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self._leader = LeaderAddress.parse(url) if url.startswith(ETCD_SCHEME) else None
        self.host, self.port = "", 0
        if self._leader is None:
            self._at(url)
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._conn: http.client.HTTPConnection | None = None

    def _at(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"orchestrator URL must be http://host:port, got {url!r}")
        self.host, self.port = u.hostname, u.port or 80

    def _find_leader(self, deadline: float) -> None:
        """Point at the announced leader (etcd-following clients only), waiting for one
        until ``deadline``; ``ServiceUnavailable`` when none is announced by then."""
        assert self._leader is not None
        self.close()
        got = self._leader.wait(max(0.0, deadline - time.monotonic()))
        if got is None:
            raise ServiceUnavailable(f"no orchestrator leader announced at {self._leader.key}")
        self._at(got.api)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ API
    def submit(
        self,
        params: dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        slo_class: str | None = None,
        cached_embeddings: bytes | None = None,
        deadline_s: float | None = None,
    ) -> str:
        # the id is chosen here, so a resent submit is a duplicate, never a second request
        body: dict[str, Any] = {
            "params": params or {},
            "request_id": request_id or uuid.uuid4().hex,
        }
        if slo_class is not None:
            body["slo_class"] = slo_class
        if cached_embeddings is not None:
            body["cached_embeddings"] = base64.b64encode(cached_embeddings).decode()
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        try:
            return self._request("POST", "/v1/requests", body)["request_id"]
        except _Resent as e:  # accepted by the leader that went away: it is in the journal
            if e.rejected.code != "duplicate_request":
                raise e.rejected from None
            return str(body["request_id"])

    def status(self, request_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/requests/{request_id}")

    def cancel(self, request_id: str, reason: str = "cancelled by client") -> dict[str, Any]:
        return self._request("POST", f"/v1/requests/{request_id}/cancel", {"reason": reason})

    def cluster(self) -> dict[str, Any]:
        return self._request("GET", "/v1/cluster")

    def reassign(self, worker_id: str, stages: list[str], reason: str = "operator") -> str:
        """Move a worker to ``stages``; its state right after (``changing``/``loading``)."""
        body = {"stages": list(stages), "reason": reason}
        return self._request("POST", f"/v1/workers/{worker_id}/reassign", body)["state"]

    def drain(self, worker_id: str, reason: str = "operator") -> str:
        """Have a worker leave; its state right after (``draining``/``removed``)."""
        return self._request("POST", f"/v1/workers/{worker_id}/drain", {"reason": reason})["state"]

    def metrics_text(self) -> str:
        return self._request("GET", "/metrics", raw=True)

    def healthz(self) -> dict[str, Any]:
        return self._request("GET", "/healthz")

    def events(self, request_id: str, *, follow: bool = True) -> Iterator[dict[str, Any]]:
        """Each event as a dict, until the request finishes (on its own connection)."""
        if self._leader is not None and not self.port:
            self._find_leader(time.monotonic() + self.timeout)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=None)
        try:
            path = f"/v1/requests/{request_id}/events" + ("" if follow else "?follow=0")
            try:
                conn.request("GET", path, headers=self._headers)
                resp = conn.getresponse()
            except OSError as e:
                raise ServiceUnavailable(f"orchestrator at {self.host}:{self.port}: {e}") from e
            if resp.status != 200:
                _raise(resp.status, resp.read())
            for line in resp:
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()

    def wait(self, request_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Poll until the request finishes or ``timeout`` passes; the last status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            st = self.status(request_id)
            if st["state"] in _TERMINAL:
                return st
            if deadline is not None and time.monotonic() >= deadline:
                return st
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    # ------------------------------------------------------------------ plumbing
    def _request(self, method: str, path: str, body: Any = None, *, raw: bool = False) -> Any:
        if self._leader is None:
            return self._request_once(method, path, body, raw=raw)
        deadline = time.monotonic() + self.timeout
        resent = False
        while True:
            try:
                if not self.port:
                    self._find_leader(deadline)
                return self._request_once(method, path, body, raw=raw)
            except ServiceUnavailable:
                if time.monotonic() >= deadline:
                    raise
                resent, self.port = True, 0  # look the leader up again, then resend
                time.sleep(0.05)
            except RequestRejected as e:
                if resent:
                    raise _Resent(e) from e
                raise

    def _request_once(self, method: str, path: str, body: Any, *, raw: bool) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):  # a kept-alive connection may have been closed by the server
            if self._conn is None:
                t = self.timeout if self._leader is None else min(self.timeout, FOLLOW_TRY_S)
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=t)
            try:
                self._conn.request(method, path, body=data, headers=headers)
                resp = self._conn.getresponse()
                payload = resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt == 2:
                    raise ServiceUnavailable(f"orchestrator at {self.host}:{self.port}: {e}") from e
        if resp.will_close:
            self.close()
        if resp.status >= 400:
            _raise(resp.status, payload)
        return payload.decode() if raw else json.loads(payload)


class _Resent(RequestRejected):
    """A rejection of a call resent to a new leader (``submit`` reads it)."""

    def __init__(self, rejected: RequestRejected) -> None:
        super().__init__(rejected.code, rejected.reason)
        self.rejected = rejected


def _raise(status: int, payload: bytes) -> None:
    try:
        err = json.loads(payload)["error"]  # OpenAI's shape: {"error": {"message", "code", ...}}
        code, message = str(err.get("code") or status), str(err.get("message", ""))
    except (ValueError, TypeError, KeyError, AttributeError):
        code, message = str(status), payload.decode(errors="replace")[:200]
    if status >= 500:
        raise ServiceUnavailable(f"{status} {code}: {message}")
    raise RequestRejected(code, f"{status} {code}: {message}")

"""The express submission route answers exactly what the router answers.

``build_app`` sends ``POST /v1/requests`` past FastAPI's router (``_Express``);
``build_app(express=False)`` sends it through the router like every other route.
Both apps here sit in front of one started ``OrchestratorService`` (no workers)
and are called in this process as ASGI apps, with the same token, so every
refusal must come back byte for byte the same (status, headers, body) and
change nothing, and an accepted submission the same shape.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgicall import Answer, post

from mooncake_diffusion.orchestrator.http.api import build_app
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.testing import thread_names

pytestmark = pytest.mark.unit

TOKEN = "t0k"


@pytest.fixture
def apps():
    baseline = thread_names()
    svc = OrchestratorService(ServiceConfig(worker_bind="tcp://127.0.0.1:0")).start()
    loop = asyncio.new_event_loop()
    try:
        yield svc, loop, build_app(svc, token=TOKEN), build_app(svc, token=TOKEN, express=False)
    finally:
        loop.close()
        svc.close()
    assert thread_names() <= baseline


def call(
    loop: asyncio.AbstractEventLoop,
    app: Any,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    path: str = "/v1/requests",
) -> Answer:
    """One POST through ``app`` with the token and JSON headers, overridden by
    ``headers``: (status, headers, body)."""
    hdrs = {
        "host": "127.0.0.1",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "authorization": f"Bearer {TOKEN}",
        **(headers or {}),
    }
    return loop.run_until_complete(post(app, path, body, hdrs))


REFUSED = [
    (b"{not json", {}),
    (b"[1, 2]", {}),
    (b'{"params": {}, "request_id": 7}', {}),
    (b'{"params": 3}', {}),
    (b'{"params": {}, "request_id": "../etc/passwd"}', {}),
    (b'{"params": {"path": "/etc/passwd"}}', {}),
    (b'{"params": {}, "slo_class": "nope"}', {}),
    (b'{"params": {}, "deadline_s": -1}', {}),
    (b'{"params": {}, "cached_embeddings": "@@not base64@@"}', {}),
    (b'{"params": {"height": 100000, "width": 100000, "frames": 999, "steps": 999}}', {}),
    (b'{"params": {}, "surprise": 1}', {}),
    (b'{"params": {}}', {"content-type": "text/plain"}),
    (b'{"params": {}}', {"host": "evil.example"}),
    (b'{"params": {}}', {"origin": "http://evil.example"}),
    (b'{"params": {}}', {"authorization": "Bearer wrong"}),
    (b'{"params": {}}', {"content-length": "x"}),
    (b'{"params": {}}', {"content-length": str(1 << 30)}),
]


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_a_refused_submission_gets_the_routers_answer_byte_for_byte(apps, case):
    svc, loop, express, routed = apps
    body, headers = REFUSED[case]
    got = call(loop, express, body, headers=headers)
    want = call(loop, routed, body, headers=headers)
    assert 400 <= want[0] < 500, want
    assert got == want
    assert svc.table.live() == []


def test_accepted_duplicate_and_failed_submissions_answer_alike(apps, monkeypatch):
    svc, loop, express, routed = apps
    a = call(loop, express, b'{"params": {"i": 1}, "request_id": "via-express"}')
    b = call(loop, routed, b'{"params": {"i": 1}, "request_id": "via-router"}')
    assert a[0] == b[0] == 201
    assert [k for k, _ in a[1]] == [k for k, _ in b[1]]  # the lengths differ with the ids
    assert dict(a[1])[b"content-type"] == dict(b[1])[b"content-type"] == b"application/json"
    sa, sb = json.loads(a[2]), json.loads(b[2])
    assert sa.keys() == sb.keys()
    assert (sa["request_id"], sb["request_id"]) == ("via-express", "via-router")
    differ = ("request_id", "submitted_at", "events")  # the ids, and when
    assert {k: v for k, v in sa.items() if k not in differ} == {
        k: v for k, v in sb.items() if k not in differ
    }
    assert [e["kind"] for e in sa["events"]] == [e["kind"] for e in sb["events"]] == ["submitted"]
    assert sorted(r.request_id for r in svc.table.live()) == ["via-express", "via-router"]

    again = b'{"params": {"i": 2}, "request_id": "via-express"}'
    dup = call(loop, express, again)
    assert dup == call(loop, routed, again) and dup[0] == 409

    # the express app answers with the route gone from its router: it does skip it
    routes = express.router.routes
    routes[:] = [r for r in routes if getattr(r, "path", "") != "/v1/requests"]
    assert call(loop, express, b'{"params": {}, "request_id": "no-route"}')[0] == 201

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("the driver fell over")

    monkeypatch.setattr(svc, "submit_async", broken)
    fault = call(loop, express, b'{"params": {}}')
    assert fault == call(loop, routed, b'{"params": {}}') and fault[0] == 500
    assert b"RuntimeError" in fault[2] and b"fell over" not in fault[2]
    assert len(svc.table.live()) == 3

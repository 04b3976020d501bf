"""The driver turning on an asyncio loop (``OrchestratorService.run_on_loop``), as
the standalone command runs it under its HTTP server (``ApiServer(drive=True)``):
a call made on that loop goes to the next turn with no hand-off, a blocking call
there is refused instead of waiting for itself, a service that cannot start fails
the server, and closing leaves nothing behind. A real service, a worker speaking
the wire protocol on a real DEALER socket, real HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import zmq

from helpers import driven, from_service
from mooncake_diffusion.orchestrator import JournalError, OrchestratorConfig
from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.http.api import ApiServer
from mooncake_diffusion.orchestrator.link.wire import Done, Hello, ItemRef, Welcome, Work, encode
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration


def config(tmp_path) -> ServiceConfig:  # type: ignore[no-untyped-def]
    return ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=60.0),
        worker_bind="tcp://127.0.0.1:0",
        journal=str(tmp_path / "orchestrator.db"),
    )


@pytest.fixture
def worker():
    """A DEALER socket as worker ``enc``; connect it to a service's address."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"enc")
    sock.setsockopt(zmq.LINGER, 0)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def welcomed(sock: zmq.Socket, svc: OrchestratorService) -> None:
    sock.connect(svc.worker_address)
    sock.send(encode(Hello("enc", "encode", credits=2)))
    assert from_service(sock, Welcome) is not None, "the worker was not welcomed"


def test_a_call_made_on_the_loop_is_taken_by_its_next_turn_without_the_mailbox(tmp_path, worker):
    baseline = thread_names()
    svc = OrchestratorService(config(tmp_path))
    with driven(svc, "loop") as loop:
        welcomed(worker, svc)
        posted, post = [], svc._post

        def counted(fn):  # type: ignore[no-untyped-def]
            posted.append(fn)
            return post(fn)

        svc._post = counted  # type: ignore[method-assign]
        done = asyncio.run_coroutine_threadsafe(
            svc.submit_async({"prompt": "a fox"}, request_id="fox-1"), loop
        )
        st = done.result(30)
        assert posted == [], "a call on the driver's loop went through the mailbox"
        assert st.request_id == "fox-1" and st.events[0].kind == "submitted"
        work = from_service(worker, Work)
        assert work is not None and work.item.request_id == "fox-1"  # type: ignore[attr-defined]
        worker.send(encode(Done("enc", ItemRef("fox-1", "encode", 1), b"emb")))
        # a call from another thread still goes through the mailbox, and is answered
        for _ in range(300):
            if "done" in [e.kind for e in svc.status("fox-1").events]:
                break
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), loop).result(5)
        assert "done" in [e.kind for e in svc.status("fox-1").events]
        assert len(posted) >= 1
    assert svc.stopped.is_set()
    assert_no_leaks(None, baseline)


def test_a_blocking_call_on_the_loop_is_refused_not_left_waiting(tmp_path):
    baseline = thread_names()
    svc = OrchestratorService(config(tmp_path))
    with driven(svc, "loop") as loop:

        async def blocking() -> object:
            return svc.cluster()  # would wait for the driver, which is this thread

        with pytest.raises(OrchestratorError, match="driver's own loop"):
            asyncio.run_coroutine_threadsafe(blocking(), loop).result(30)
        assert svc.cluster()["counters"].get("driver_errors", 0) == 0  # still serving
    assert_no_leaks(None, baseline)


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_http_server_drives_the_service_on_its_own_loop(tmp_path, worker):
    baseline = thread_names()
    svc = OrchestratorService(config(tmp_path))
    api = ApiServer(svc, "127.0.0.1", 0, drive=True)
    try:
        welcomed(worker, svc)
        code, st = http("POST", f"{api.url}/v1/requests", {"params": {}, "request_id": "r-1"})
        assert code == 201, st
        work = from_service(worker, Work)
        assert work is not None and work.item.request_id == "r-1"  # type: ignore[attr-defined]
        code, view = http("GET", f"{api.url}/v1/cluster")  # a thread of the pool: the mailbox
        assert code == 200 and [w["worker_id"] for w in view["workers"]] == ["enc"], view
        code, st = http("GET", f"{api.url}/v1/requests/r-1")
        assert code == 200 and st["request_id"] == "r-1", st
        code, err = http("GET", f"{api.url}/v1/requests/nope")
        assert code == 404, err
    finally:
        svc.close()
        api.close()
    assert svc.stopped.is_set()
    # the driver left the loop and closed the journal: a new service recovers from it
    again = OrchestratorService(config(tmp_path))
    with driven(again, "thread"):
        assert again.status("r-1").request_id == "r-1"
    assert_no_leaks(None, baseline)


def test_a_service_that_cannot_start_fails_the_http_server(tmp_path):
    baseline = thread_names()
    (tmp_path / "orchestrator.db").mkdir()  # the journal's path is a folder
    svc = OrchestratorService(config(tmp_path))
    with pytest.raises(JournalError, match=r"orchestrator\.db: cannot open"):
        ApiServer(svc, "127.0.0.1", 0, drive=True)
    with pytest.raises(OrchestratorError):  # it is not running, and says so
        svc.cluster()
    svc.close()
    assert_no_leaks(None, baseline)

"""The service's client API over the bridge (``orchestrator/service/bridge.py``), which the
HTTP front in its own process (``--front-process``) serves: the same answers and
errors as the in-process API, a driver that does not answer in time or a bridge
that went away is ``ServiceUnavailable`` (and the next call connects again), a
call of another bridge version is refused. In-process: a real service, a real
Unix socket, real StageWorkers over the in-memory transport; the child process
itself is in ``tests/faults/test_front_process.py``."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import threading
import time

import msgspec
import pytest
from apistack import Stack, raw

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.http.remote import RemoteService
from mooncake_diffusion.orchestrator.service.bridge import Call, Reply, frame, read_reply
from mooncake_diffusion.orchestrator.service.service import RequestRejected, ServiceUnavailable
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration


@pytest.fixture
def stack():
    baseline = thread_names()
    s = Stack(bridged=True)
    yield s
    s.close_released()  # also: the socket's folder is gone
    assert_no_leaks(None, baseline)


def http_call(stack: Stack, method: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    return raw(stack.api, method, path, data, headers)


def test_the_sync_calls_streams_and_views_cross_the_bridge(stack):
    # (the HTTP pipeline itself, bridged: test_orchestrator_api.py's flow test)
    folder = os.stat(os.path.dirname(stack.bridge.path))
    assert stat.S_IMODE(folder.st_mode) == 0o700  # only this user reaches the socket
    stack.pipeline()
    rid = stack.remote.submit({"prompt": "x", "size": 64, "steps": 1}, request_id="sync-1")
    assert rid == "sync-1"
    assert stack.remote.wait(rid, timeout=60).output is not None
    assert stack.remote.status(rid).state == "completed"
    streamed = [e.kind for e in stack.remote.events(rid)]
    assert streamed[0] == "submitted" and streamed[-1] == "completed", streamed
    assert 'requests_finished_total{outcome="completed"} 1.0' in stack.remote.metrics_text()
    view = stack.remote.cluster()
    assert sorted(w["stages"][0] for w in view["workers"]) == ["decode", "denoise", "encode"]


def test_errors_keep_their_type_and_code_across_the_bridge(stack):
    assert http_call(stack, "POST", "/v1/requests", {"request_id": "a"})[0] == 201
    status, body = http_call(stack, "POST", "/v1/requests", {"request_id": "a"})
    assert (status, body["error"]["code"]) == (409, "duplicate_request"), body
    status, body = http_call(stack, "GET", "/v1/requests/nope")
    assert (status, body["error"]["code"]) == (404, "unknown_request"), body
    # refused by the service's own check, in the driver's process
    status, body = http_call(stack, "POST", "/v1/requests", {"request_id": "b", "deadline_s": -1.0})
    assert (status, body["error"]["code"]) == (400, "bad_value"), body
    status, body = http_call(stack, "POST", "/v1/workers/ghost/drain", {})
    assert (status, body["error"]["code"]) == (404, "unknown_worker"), body
    status, body = http_call(stack, "POST", "/v1/workers/ghost/reassign", {"stages": ["decode"]})
    assert (status, body["error"]["code"]) == (404, "unknown_worker"), body
    assert http_call(stack, "POST", "/v1/requests/a/cancel")[1]["state"] == "cancelled"
    status, body = http_call(stack, "POST", "/v1/requests/a/cancel")
    assert (status, body["error"]["code"]) == (409, "already_finished"), body
    with pytest.raises(RequestRejected) as e:
        list(stack.remote.events("nope"))
    assert e.value.code == "unknown_request"
    # nothing bad input did changed state: one request, the cancelled one
    assert stack.client.cluster()["counters"]["submitted"] == 1


def test_a_driver_that_does_not_answer_in_time_is_unavailable_then_answers_again(stack):
    remote = RemoteService(stack.bridge.path, call_timeout_s=0.3)
    stuck = threading.Event()

    def hold() -> None:  # the driver is busy for longer than the remote's call timeout
        stuck.set()
        time.sleep(1.5)

    holder = threading.Thread(target=stack.svc._call, args=(hold,))
    holder.start()
    try:
        assert stuck.wait(10)
        with pytest.raises(ServiceUnavailable, match=r"did not answer within 0\.3 s"):
            remote.status("x")
        with pytest.raises(ServiceUnavailable, match=r"did not answer within 0\.3 s"):
            asyncio.run(remote.status_async("x"))
    finally:
        holder.join()
    with pytest.raises(RequestRejected):  # answered again, on a new connection
        remote.status("x")
    remote.close()
    with pytest.raises(ServiceUnavailable, match="closed"):
        remote.status("x")


def test_another_bridge_version_is_refused_and_a_gone_bridge_is_unavailable():
    baseline = thread_names()
    s = Stack(bridged=True)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(s.bridge.path)
            sock.sendall(frame(Call(7, "status", {"request_id": "x"}, v=99)))
            reply = read_reply(sock)
        assert reply.id == 7 and reply.fault is not None and reply.fault.kind == "error"
        assert "version 99" in reply.fault.message
        with socket.socket(socket.AF_UNIX) as sock:  # garbage: the connection is closed
            sock.settimeout(10)
            sock.connect(s.bridge.path)
            sock.sendall(b"\x00\x00\x00\x03abc")
            assert sock.recv(10) == b""
        assert isinstance(msgspec.msgpack.decode(frame(reply)[4:], type=Reply), Reply)
        with pytest.raises(OrchestratorError, match="no bridge call"):
            s.remote._call("format_disk", {})
    finally:
        s.close_released()
    remote = RemoteService(s.bridge.path, call_timeout_s=2)
    with pytest.raises(ServiceUnavailable, match="not answering"):
        remote.status("x")
    with pytest.raises(ServiceUnavailable, match="not answering"):
        asyncio.run(remote.submit_async({}))
    assert_no_leaks(None, baseline)

"""The orchestrator service in library mode and over HTTP: requests through StageWorkers,
cancellation, bad input of every kind, auth. In-process (threads, loopback sockets) with
the in-memory transport; the real-process and real-Mooncake runs are in
test_orchestrator_processes.py."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time

import msgspec
import pytest
import torch
import zmq
from apistack import Stack, raw
from gated import held
from prometheus_client.parser import text_string_to_metric_families

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.http.api import MAX_BODY, ApiServer
from mooncake_diffusion.orchestrator.link.wire import (
    Bye,
    Done,
    Hello,
    ItemRef,
    Leave,
    Progress,
    Refused,
    Welcome,
    decode_from_service,
    encode,
)
from mooncake_diffusion.orchestrator.service.service import (
    OrchestratorService,
    RequestRejected,
    ServiceConfig,
)
from mooncake_diffusion.orchestrator.worker import toy
from mooncake_diffusion.orchestrator.worker.runtime import StageWorker
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import StagePayload

pytestmark = pytest.mark.integration


@pytest.fixture
def stack(request):
    """``Stack()``; a test parametrized ``indirect`` with True gets it ``bridged``."""
    s = Stack(bridged=getattr(request, "param", False))
    yield s
    s.close_released()


@pytest.mark.parametrize("stack", [False, True], ids=["in-process", "bridged"], indirect=True)
def test_requests_flow_through_every_stage_with_events_and_metrics(stack):
    stack.pipeline()
    params = [{"prompt": f"p{i}", "size": 256, "steps": 3} for i in range(5)]
    rids = [stack.client.submit(p, slo_class="interactive") for p in params]
    for rid, p in zip(rids, params, strict=True):
        st = stack.client.wait(rid, timeout=60)
        assert st["state"] == "completed", st
        out = json.loads(base64.b64decode(st["output"]))
        assert out["checksum"] == pytest.approx(toy.expected_checksum(p), rel=1e-6)
        kinds = [e["kind"] for e in st["events"]]
        assert kinds[0] == "submitted" and kinds[-1] == "completed"
        stages = [e["stage"] for e in st["events"] if e["kind"] == "dispatched"]
        assert stages == ["encode", "denoise", "decode"]
    streamed = list(stack.client.events(rids[0]))
    assert [e["kind"] for e in streamed][-1] == "completed"
    text = stack.client.metrics_text()
    assert 'mcd_orchestrator_requests_finished_total{outcome="completed"} 5.0' in text
    assert 'mcd_orchestrator_dispatches_total{stage="denoise"} 5.0' in text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition
    for stage in ("encode", "denoise", "decode"):
        for hist in ("dispatch_wait_seconds", "stage_run_seconds"):
            counts = [
                s.value
                for s in families[f"mcd_orchestrator_{hist}"].samples
                if s.name.endswith("_count") and s.labels == {"stage": stage}
            ]
            assert counts == [5.0], (hist, stage, counts)
    ages = families["mcd_orchestrator_worker_heartbeat_age_seconds"].samples
    assert sorted(s.labels["stage"] for s in ages) == ["decode", "denoise", "encode"]
    assert all(s.value >= 0 for s in ages)
    in_use = families["mcd_orchestrator_credits_in_use"].samples
    assert {s.labels["stage"]: s.value for s in in_use} == {"encode": 0, "denoise": 0, "decode": 0}
    assert stack.client.healthz() == {"status": "ok"}


def _reported(stack, wid: str, want: dict[str, int], deadline_s: float = 30.0) -> None:
    """Poll ``GET /v1/cluster`` until worker ``wid``'s ``memory`` has the ``want``
    values (its beats carry what the release thread last looked at)."""
    end = time.monotonic() + deadline_s
    seen: object = "no such worker"
    while time.monotonic() < end:
        mine = [w for w in stack.client.cluster()["workers"] if w["worker_id"] == wid]
        seen = mine[0]["memory"] if mine else "no such worker"
        if isinstance(seen, dict) and all(seen.get(k) == v for k, v in want.items()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{wid} reported {seen}, not {want}, within {deadline_s} s")


def _memory_gauges(stack) -> dict[str, dict[str, float]]:
    """``mcd_orchestrator_worker_memory_bytes`` by worker id, then kind."""
    families = {f.name: f for f in text_string_to_metric_families(stack.client.metrics_text())}
    out: dict[str, dict[str, float]] = {}
    for s in families["mcd_orchestrator_worker_memory_bytes"].samples:
        out.setdefault(s.labels["worker_id"], {})[s.labels["kind"]] = s.value
    return out


@pytest.mark.parametrize("stack", [False, True], ids=["in-process", "bridged"], indirect=True)
def test_workers_report_what_their_connectors_hold(stack):
    """Each worker's beats say what its connector holds (``Beat.memory``), and the
    cluster view and ``/metrics`` show the last report: here a payload received into
    a decode worker's receive pool shows as pool bytes in use until it is released,
    and its receive pool as registered bytes. A worker that leaves takes its report
    and its series with it."""
    stack.pipeline()
    dec = stack.worker("decode", worker_id="dec-mem")
    src = DiffusionConnector("denoise", "memory", MooncakeSettings())
    stack.connectors.append(src)
    _reported(stack, dec.worker_id, {"pool_bytes_in_use": 0, "late_write_bytes": 0})
    pub = src.publish(StagePayload("mem-r", "latent", tensors={"x": torch.ones(1024, 256)}))
    got = dec.connector.consume(pub.handle)
    try:
        registered = dec.connector.stats().registered_bytes
        assert registered > 0  # the receive pool the payload landed in
        want = {
            "registered_bytes": registered,
            "pool_bytes_in_use": 1 << 20,
            "late_write_bytes": 0,
            "live_publications": 0,
        }
        _reported(stack, dec.worker_id, want)  # the whole report, pool and payload alike
        gauge = _memory_gauges(stack)[dec.worker_id]
        assert gauge == {"registered": registered, "pool_in_use": 1 << 20, "late_write": 0}
    finally:
        got.release()
    _reported(stack, dec.worker_id, {"pool_bytes_in_use": 0})
    assert _memory_gauges(stack)[dec.worker_id]["pool_in_use"] == 0
    dec.stop()  # says Bye: the orchestrator removes it
    deadline = time.monotonic() + 30
    while dec.worker_id in _memory_gauges(stack) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dec.worker_id not in _memory_gauges(stack)
    assert dec.worker_id not in stack.svc._memory  # the report went with the worker


@pytest.mark.parametrize("stack", [False, True], ids=["in-process", "bridged"], indirect=True)
def test_a_stream_that_ends_before_its_request_leaves_no_subscriber(stack):
    """An event stream read without following (``?follow=0``, ``timeout=0``), or closed
    by its reader, stops following its request: each one left its queue on the driver
    until the request finished, and every later event was put into all of them."""
    rid = stack.client.submit({"prompt": "p", "size": 256, "steps": 3})  # no worker: it waits
    svc = stack.svc

    def subscribers() -> int:  # on the driver, after whatever was posted before
        return svc._call(lambda: len(svc.table._subs.get(rid, ())))

    for _ in range(3):
        assert [e["kind"] for e in stack.client.events(rid, follow=False)] == ["submitted"]
        assert [e.kind for e in svc.events(rid, timeout=0)] == ["submitted"]
    following = svc.events(rid)
    assert next(following).kind == "submitted"
    assert subscribers() == 1  # a reader that follows is followed
    following.close()  # ... until it gives up
    assert subscribers() == 0
    assert stack.client.cancel(rid)["state"] == "cancelled"


def test_cached_embeddings_skip_encode(stack):
    stack.worker("denoise")
    stack.worker("decode")
    enc = DiffusionConnector("encode", "memory", MooncakeSettings())
    try:
        import numpy as np

        from mooncake_diffusion.transfer.payload import StagePayload

        emb = np.ones(64, np.float32)
        pub = enc.publish(StagePayload(request_id="cached", kind="embedding", tensor=emb))
        pub.wait(10)
        rid = stack.svc.submit({"steps": 1}, request_id="cached", cached_embeddings=pub.encode())
        st = stack.svc.wait(rid, timeout=30)
        assert st.state == "completed"
        assert [e.stage for e in st.events if e.kind == "dispatched"] == ["denoise", "decode"]
        out = msgspec.json.decode(st.output)
        assert out["checksum"] == pytest.approx(64 * 1.5)
    finally:
        enc.close()


def until_cancelled(ctx, _step) -> None:
    while not ctx.cancelled:
        time.sleep(0.005)


def test_progress_is_streamed_and_cancel_stops_a_running_item(stack):
    stack.worker("encode")
    # held inside step 3 until cancelled: the cancel always finds the item running
    den = stack.worker("denoise", held(toy.denoise, 3, until_cancelled))
    stack.worker("decode")
    rid = stack.svc.submit({"steps": 10, "size": 64})
    steps = []
    for ev in stack.svc.events(rid, timeout=30):
        if ev.kind == "progress":
            steps.append(ev.step)
            if len(steps) == 3:
                break
    assert steps == [1, 2, 3]
    st = stack.svc.cancel(rid)
    assert st.state == "cancelled"
    with pytest.raises(RequestRejected) as e:
        stack.svc.cancel(rid)
    assert e.value.code == "already_finished"
    deadline = time.monotonic() + 10
    while den._running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not den._running, "the revoked item kept running"
    assert den.items_done == 0


def test_a_failing_stage_fails_the_request_with_its_reason(stack):
    stack.pipeline()
    rid = stack.svc.submit({"fail": "denoise"})
    st = stack.svc.wait(rid, timeout=30)
    assert st.state == "failed"
    assert any("asked to fail at denoise" in r for r in st.reasons), st.reasons


def test_http_bad_input_gets_4xx_and_changes_nothing(stack):
    api = stack.api
    j = {"Content-Type": "application/json"}
    cases = [
        ("POST", "/v1/requests", b"{not json", j, 400),
        ("POST", "/v1/requests", b"[1, 2]", j, 400),
        ("POST", "/v1/requests", b'{"params": 3}', j, 400),
        ("POST", "/v1/requests", b'{"paramz": {}}', j, 400),
        ("POST", "/v1/requests", b'{"slo_class": "gold"}', j, 400),
        ("POST", "/v1/requests", b'{"deadline_s": -1}', j, 400),
        ("POST", "/v1/requests", b'{"cached_embeddings": "@@"}', j, 400),
        ("POST", "/v1/requests", b'{"params": {"out_dir": "/tmp"}}', j, 400),
        ("POST", "/v1/requests", b'{"request_id": "a/b"}', j, 400),
        ("POST", "/v1/requests", b'{"request_id": ""}', j, 400),
        ("POST", "/v1/requests", b"{}", {"Content-Type": "text/plain"}, 415),
        ("POST", "/v1/requests", b"{}", {}, 415),  # no Content-Type: a cross-site form
        ("POST", "/v1/requests", b"x" * (MAX_BODY + 1), j, 413),
        ("GET", "/v1/requests/nope", None, {}, 404),
        ("POST", "/v1/requests/nope/cancel", None, {}, 404),
        ("GET", "/v1/requests/nope/events", None, {}, 404),
        ("DELETE", "/v1/requests", None, {}, 405),
        ("GET", "/v2/whatever", None, {}, 404),
        ("GET", "/healthz", None, {"Host": "evil.example"}, 421),
        ("POST", "/v1/requests", b"{}", {**j, "Origin": "http://evil.example"}, 403),
    ]
    for method, path, body, headers, want in cases:
        status, err = raw(api, method, path, body, headers)
        assert status == want, (method, path, body and body[:40], status, err)
        e = err["error"]  # OpenAI's shape
        assert e["message"] and e["code"] and e["type"] and "param" in e, err
    big = {"params": {"x": "y" * 70_000}}
    assert raw(api, "POST", "/v1/requests", json.dumps(big).encode(), j)[0] == 400
    rid = stack.client.submit({"prompt": "ok"}, request_id="dup")
    with pytest.raises(RequestRejected) as e:
        stack.client.submit({}, request_id="dup")
    assert e.value.code == "duplicate_request"
    view = stack.client.cluster()
    assert view["queued"]["encode"] == [rid], view  # only the one good request exists


def test_bad_worker_frames_are_refused_without_disturbing_other_work(stack):
    stack.pipeline()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.ROUTING_ID, b"rogue")
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(stack.svc.worker_address)
    try:

        def answer(frame: bytes):
            rogue.send(frame)
            assert rogue.poll(5000), "no answer"
            return decode_from_service(rogue.recv())

        assert answer(b"\x00garbage").code == "bad_message"
        wrong_version = msgspec.msgpack.encode(["mcd-orch", 99, msgspec.Raw(b"\x90")])
        r = answer(wrong_version)
        assert r.code == "bad_message" and "version 99" in r.reason
        r = answer(encode(Hello("rogue", "painting")))
        assert isinstance(r, Refused) and r.code == "unknown_stage"
        assert isinstance(answer(encode(Hello("rogue", "decode"))), Welcome)
        r = answer(encode(Done("rogue", ItemRef("r-none", "decode", 1), b"x")))
        assert isinstance(r, Refused) and r.code in ("unknown_request", "not_held"), r
        r = answer(encode(Done("someone-else", ItemRef("r", "decode", 1))))
        assert r.code == "bad_value"
    finally:
        rogue.close()
        ctx.term()
    rid = stack.svc.submit({"prompt": "still fine", "steps": 1})
    assert stack.svc.wait(rid, timeout=30).state == "completed"


def test_non_loopback_needs_a_token_and_the_token_is_enforced():
    with pytest.raises(OrchestratorError, match="token"):
        ServiceConfig(worker_bind="tcp://0.0.0.0:7422")
    svc = OrchestratorService(ServiceConfig(worker_bind="tcp://127.0.0.1:0")).start()
    try:
        with pytest.raises(OrchestratorError, match="token"):
            ApiServer(svc, "0.0.0.0", 0)
    finally:
        svc.close()
    s = Stack(token="s3cret")
    try:
        status, err = raw(s.api, "GET", "/v1/cluster")
        assert status == 401 and err["error"]["code"] == "unauthorized"
        assert raw(s.api, "GET", "/healthz")[0] == 200
        assert s.client.cluster()["workers"] == []
        bad = StageWorker(
            "decode",
            toy.decode,
            s.svc.worker_address,
            connector=DiffusionConnector("decode", "memory", MooncakeSettings()),
            token="wrong",
            connect_timeout_s=3,
        )
        s.connectors.append(bad.connector)
        with pytest.raises(OrchestratorError):
            bad.run(install_signal_handlers=False)
        s.worker("decode")
        assert [w["stage"] for w in s.client.cluster()["workers"]] == ["decode"]
    finally:
        s.close()


def test_with_a_token_a_connection_that_takes_a_workers_id_cannot_speak_for_it():
    """ZeroMQ hands a routing id to the newest connection that claims it
    (``ROUTER_HANDOVER``: a restarted worker gets its id back), and with a token the
    service checked only that the id had said Hello with it: a rogue that connected
    under a live worker's id, token unknown, could send its Leave, Bye or results.
    Now every frame after Hello carries the session key of that connection's
    ``Welcome``: the rogue's frames are refused and change nothing, while the
    workers (which stamp the key on theirs) serve requests. Not prevented: the
    worker whose id was taken hears nothing until it is given up (heartbeat
    timeout), as before (60 s here, so that the check below does not race it)."""
    s = Stack(token="s3cret", heartbeat_timeout=60.0)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    try:
        s.pipeline()
        rid = s.client.submit({"prompt": "keyed", "size": 256, "steps": 2})
        assert s.client.wait(rid, timeout=60)["state"] == "completed"  # stamped frames pass
        dec = next(w for w in s.workers if w.stage == "decode")
        rogue.setsockopt(zmq.ROUTING_ID, dec.worker_id.encode())
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(s.svc.worker_address)
        for frame in (
            Leave(dec.worker_id, "hijacked"),
            Leave(dec.worker_id, "hijacked", session="0" * 32),  # a guessed key
            Bye(dec.worker_id, "hijacked"),
        ):
            rogue.send(encode(frame))
        deadline = time.monotonic() + 30  # counted: the refusal goes to whoever holds the id
        while s.client.cluster()["counters"].get("unauthorized", 0) < 3:
            assert time.monotonic() < deadline, s.client.cluster()["counters"]
            time.sleep(0.05)
        # an id that never said Hello has no key: no session passes, "" or NUL alike
        nobody = ctx.socket(zmq.DEALER)
        nobody.setsockopt(zmq.ROUTING_ID, b"nobody")
        nobody.setsockopt(zmq.LINGER, 0)
        nobody.connect(s.svc.worker_address)
        try:
            for key in ("", "\0"):
                nobody.send(encode(Progress("nobody", ItemRef("r-none", "denoise", 1), 1, 2, key)))
                assert nobody.poll(10_000), "no answer"
                r = decode_from_service(nobody.recv())
                assert isinstance(r, Refused) and r.code == "unauthorized", r
        finally:
            nobody.close()
        states = {w["worker_id"]: w["state"] for w in s.client.cluster()["workers"]}
        assert states.get(dec.worker_id) == "serving", states  # neither drained nor gone
    finally:
        rogue.close()
        ctx.term()
        for w in s.workers:  # the one whose id was taken hears nothing more: stop it now
            if w.stage == "decode":
                w.stop()
        s.close_released()


def test_a_worker_that_drains_hands_its_denoise_job_back_and_takes_no_more(stack):
    """drain() (what SIGTERM calls) says Leave: the running denoise job is asked to
    yield at its next step boundary and goes back to the queue, not failed; nothing
    new is taken; the worker exits once it holds nothing."""
    asked = threading.Event()

    def until_asked(ctx, _k: int) -> None:  # held inside step 1 until asked to yield
        deadline = time.monotonic() + 30
        while not ctx.should_yield and time.monotonic() < deadline:
            time.sleep(0.005)
        asked.set()

    stack.worker("encode")
    den = stack.worker("denoise", held(toy.denoise, 1, until_asked))
    stack.worker("decode")
    first = stack.svc.submit({"steps": 5, "size": 64})
    for ev in stack.svc.events(first, timeout=30):
        if ev.kind == "progress":
            break
    second = stack.svc.submit({"steps": 1, "size": 64})
    den.drain()
    assert asked.wait(30)
    den.join(10)
    assert den.items_done == 0 and den.items_failed == 0
    for rid in (first, second):  # nobody left to denoise them: they wait, not failed
        st = stack.svc.status(rid)
        assert st.state == "queued" and not st.reasons, st
    stack.worker("denoise")
    for rid in (first, second):
        assert stack.svc.wait(rid, timeout=30).state == "completed"
    kinds = [e.kind for e in stack.svc.status(first).events]
    assert "yielded" in kinds and "requeued" not in kinds, kinds


def test_library_mode_wait_and_events_agree(stack):
    stack.pipeline()
    rid = stack.svc.submit({"prompt": "lib", "steps": 2})
    seen = []
    t = threading.Thread(target=lambda: seen.extend(stack.svc.events(rid)))
    t.start()
    st = stack.svc.wait(rid, timeout=30)
    t.join(10)
    assert st.state == "completed"
    assert [e.kind for e in seen if e.kind != "progress"] == [e.kind for e in st.events]


def test_an_unread_body_never_becomes_the_next_request(stack):
    """Found by fuzzing: a refused request whose body the route never read (an unknown
    route, a wrong method) left that body in the kept-alive stream, where it was parsed
    as the next request (a 501 HTML page instead of that request's answer)."""
    conn = http.client.HTTPConnection(stack.api.host, stack.api.port, timeout=10)
    try:
        for method, path in (("POST", "/v1/nope"), ("PUT", "/v1/requests"), ("POST", "/healthz")):
            conn.request(method, path, body=b'{"a": 1}', headers={"Content-Type": "text/plain"})
            resp = conn.getresponse()
            assert resp.status in (404, 405), resp.status
            assert "error" in json.loads(resp.read())
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            assert (resp.status, json.loads(resp.read())) == (200, {"status": "ok"})
    finally:
        conn.close()


def test_openapi_docs_are_served_and_list_every_route(stack):
    conn = http.client.HTTPConnection(stack.api.host, stack.api.port, timeout=10)
    try:
        conn.request("GET", "/docs")
        resp = conn.getresponse()
        page = resp.read().decode()
        assert resp.status == 200 and "swagger" in page.lower() and "/openapi.json" in page
    finally:
        conn.close()
    status, spec = raw(stack.api, "GET", "/openapi.json")
    assert status == 200
    paths = spec["paths"]
    for path in (
        "/v1/requests",
        "/v1/requests/{request_id}",
        "/v1/requests/{request_id}/cancel",
        "/v1/requests/{request_id}/events",
        "/v1/cluster",
        "/metrics",
        "/healthz",
        "/v1/images/generations",
        "/v1/videos",
        "/v1/videos/{video_id}/content",
    ):
        assert path in paths, sorted(paths)
    body = paths["/v1/requests"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {
        "params",
        "request_id",
        "slo_class",
        "cached_embeddings",
        "deadline_s",
    }
    assert "RequestStatus" in spec["components"]["schemas"]


def _answer(sock: socket.socket) -> tuple[int, dict]:
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, json.loads(resp.read())


def test_slow_and_unsized_bodies_are_refused_without_changing_state():
    svc = OrchestratorService(ServiceConfig(worker_bind="tcp://127.0.0.1:0")).start()
    api = ApiServer(svc, "127.0.0.1", 0, body_timeout_s=0.5)
    try:
        # a client that announces 100 bytes and sends 10 gets 408 once the limit passes
        sock = socket.create_connection((api.host, api.port), timeout=30)
        with sock:
            sock.sendall(
                b"POST /v1/requests HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"params":'
            )
            status, err = _answer(sock)
        assert (status, err["error"]["code"]) == (408, "timeout"), err
        # a chunked body without a length
        sock = socket.create_connection((api.host, api.port), timeout=30)
        with sock:
            sock.sendall(
                b"POST /v1/requests HTTP/1.1\r\nHost: localhost\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                b"2\r\n{}\r\n0\r\n\r\n"
            )
            status, err = _answer(sock)
        assert (status, err["error"]["code"]) == (411, "length_required"), err
        assert svc.cluster()["queued"]["encode"] == []
    finally:
        svc.close()
        api.close()

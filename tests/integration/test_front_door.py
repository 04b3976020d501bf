"""The HTTP front door against abuse: bench/front_door.py's catalogue of bad requests
(status, OpenAI's error shape, nothing left behind), the official ``openai`` client's
view of our errors, cost admission, cancellation by DELETE and by hanging up, the
connection limits, and /healthz under a flood. In-process service and API on
loopback with StageWorkers running the toy stages over the in-memory transport; the
same catalogue runs against the demo's real stack in bench/front_door.py."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import sys
import time
from pathlib import Path

import openai
import pytest
from apistack import Stack, raw

from mooncake_diffusion.orchestrator.http.api import MAX_BODY
from mooncake_diffusion.orchestrator.http.front import FrontConfig
from mooncake_diffusion.orchestrator.http.limits import HttpLimits

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_spec = importlib.util.spec_from_file_location(
    "bench_front_door", Path(__file__).resolve().parents[2] / "bench" / "front_door.py"
)
fd = importlib.util.module_from_spec(_spec)
sys.modules["bench_front_door"] = fd  # its dataclasses look their module up
_spec.loader.exec_module(fd)

BODY_S = 0.5


class Front(Stack):
    """``Stack`` with an outputs folder, a short body timeout and a toy worker per stage."""

    def __init__(self, outputs: Path, limits: HttpLimits | None = None, **front) -> None:
        api = {"outputs": outputs, "body_timeout_s": BODY_S, "front": FrontConfig(**front)}
        super().__init__(api={**api, "limits": limits})
        self.pipeline()

    def state(self):
        v = self.svc.cluster()
        free = sum(w["free"] for w in v["workers"])
        return ({s: len(q) for s, q in v["queued"].items()}, len(v["running"]), free)

    def wait_workers(self) -> None:
        deadline = time.monotonic() + 30
        while len(self.svc.cluster()["workers"]) < 3:
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.02)


@pytest.fixture
def front(tmp_path):
    f = Front(tmp_path / "outputs")
    f.wait_workers()
    yield f
    f.close_released()


def http_json(f: Front, method: str, path: str, body=None, headers=None):
    return raw(f.api, method, path, body, headers, timeout=30)


def test_every_abuse_case_gets_its_status_the_error_shape_and_leaves_nothing(front, tmp_path):
    canary = tmp_path / "canary"
    canary.mkdir()
    cases = fd.abuse_cases(canary, MAX_BODY)
    assert len(cases) >= 20
    rows = fd.run_cases(front.api.host, front.api.port, cases, front.state, BODY_S + 20)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert list(canary.iterdir()) == []  # no request wrote where it asked to
    assert front.svc.cluster()["queued"] == {"encode": [], "denoise": [], "decode": []}


def test_the_openai_client_shows_the_servers_reason(front):
    rows = fd.openai_cases(front.api.url, front.state)
    assert rows and all(r["ok"] for r in rows), rows
    client = openai.OpenAI(base_url=f"{front.api.url}/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(prompt="p", n=0)
        assert "n:" in e.value.message and e.value.code == "bad_value", e.value.message
        with pytest.raises(openai.NotFoundError) as e:
            client.images.generate(prompt="p", model="dall-e-9")
        assert "dall-e-9" in e.value.message and e.value.code == "model_not_found"
        assert e.value.param == "model"
        assert [m.id for m in client.models.list()] == ["mooncake-diffusion"]
    finally:
        client.close()


def test_out_dir_and_ids_are_refused_before_anything_is_queued(front, tmp_path):
    status, err = http_json(
        front,
        "POST",
        "/v1/requests",
        json.dumps({"params": {"out_dir": str(tmp_path)}}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 400 and err["error"]["param"] == "params.out_dir", err
    # the id rule is the workers' own: what the API accepts, a worker can key
    from mooncake_diffusion.transfer.payload import request_id_problem

    for rid in ("a/b", "", "x" * 257, "tab\there"):
        assert request_id_problem(rid) is not None
        body = json.dumps({"request_id": rid}).encode()
        status, err = http_json(
            front, "POST", "/v1/requests", body, {"Content-Type": "application/json"}
        )
        assert (status, err["error"]["code"]) == (400, "bad_request_id"), (rid, err)
    assert front.state()[0] == {"encode": 0, "denoise": 0, "decode": 0}


def test_cost_ceiling_is_per_class_and_configurable(tmp_path):
    f = Front(tmp_path / "out", max_cost={"interactive": 64 * 64 * 12, "batch": 10**12})
    try:
        j = {"Content-Type": "application/json"}
        small = {"params": {"prompt": "p", "steps": 12}}
        big = {"params": {"prompt": "p", "steps": 13}}
        status, err = http_json(f, "POST", "/v1/requests", json.dumps(big).encode(), j)
        assert (status, err["error"]["code"]) == (400, "too_costly"), err
        assert "interactive" in err["error"]["message"]
        batch = {**big, "slo_class": "batch", "request_id": "b1"}
        assert http_json(f, "POST", "/v1/requests", json.dumps(batch).encode(), j)[0] == 201
        ok = {**small, "request_id": "s1"}
        assert http_json(f, "POST", "/v1/requests", json.dumps(ok).encode(), j)[0] == 201
        f.wait_workers()
        for rid in ("b1", "s1"):
            assert f.svc.wait(rid, timeout=30).state == "completed"
    finally:
        f.close_released()


def hold_denoise(f: Front) -> None:
    """Drain the denoise worker: requests wait in the denoise queue from now on."""
    w = next(w for w in f.workers if w.stage == "denoise")
    w.drain()
    w.join(10)


def test_delete_cancels_a_video_and_hanging_up_cancels_images(front):
    j = {"Content-Type": "application/json"}
    hold_denoise(front)
    body = {"prompt": "slow", "size": "64x64"}
    status, video = http_json(front, "POST", "/v1/videos", json.dumps(body).encode(), j)
    assert status == 200, video
    vid = video["id"]
    status, gone = http_json(front, "DELETE", f"/v1/videos/{vid}")
    assert (status, gone) == (200, {"id": vid, "object": "video.deleted", "deleted": True})
    assert front.svc.wait(vid, timeout=30).state == "cancelled"
    assert http_json(front, "GET", f"/v1/videos/{vid}")[0] == 404
    # a client that hangs up while it waits for its images cancels them
    s = socket.create_connection((front.api.host, front.api.port), timeout=10)
    payload = json.dumps({"prompt": "p", "n": 2}).encode()
    s.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    deadline = time.monotonic() + 30
    while not [r for q in front.svc.cluster()["queued"].values() for r in q]:
        assert time.monotonic() < deadline, "the images were never queued"
        time.sleep(0.02)
    rids = [r for q in front.svc.cluster()["queued"].values() for r in q]
    s.close()
    for rid in rids:
        st = front.svc.wait(rid, timeout=30)
        assert st.state == "cancelled" and "disconnected" in " ".join(st.reasons), st


def test_streams_are_capped_per_client_and_health_answers_under_a_flood(tmp_path):
    limits = HttpLimits(max_streams_per_client=3, max_streams=4, header_timeout_s=1.0)
    f = Front(tmp_path / "out", limits=limits)
    conns = []
    try:
        f.wait_workers()
        hold_denoise(f)
        j = {"Content-Type": "application/json"}
        body = json.dumps({"request_id": "held", "params": {"prompt": "p"}}).encode()
        assert http_json(f, "POST", "/v1/requests", body, j)[0] == 201
        got = []
        for _ in range(4):
            c = http.client.HTTPConnection(f.api.host, f.api.port, timeout=10)
            c.request("GET", "/v1/requests/held/events")
            r = c.getresponse()
            got.append(r.status)
            if r.status != 200:
                assert json.loads(r.read())["error"]["code"] == "too_many_requests"
            conns.append(c)
        assert got == [200, 200, 200, 429], got
        # 1,000 idle connections: /healthz and /metrics still answer at once
        with fd.idle_connections(f.api.host, f.api.port, 1000) as idle:
            assert len(idle) == 1000
            assert http_json(f, "GET", "/healthz") == (200, {"status": "ok"})
            assert http_json(f, "GET", "/readyz")[0] == 503  # no denoise worker now
            assert len(fd.timed(f.api.host, f.api.port, "/metrics", 3)) == 3
            # the header timeout closes a connection that never sends a request
            idle[0].settimeout(10)
            assert idle[0].recv(1) == b""
    finally:
        for c in conns:
            c.close()
        f.svc.cancel("held")
        f.close_released()


def test_readyz_reflects_the_workers(tmp_path):
    f = Front(tmp_path / "out")
    try:
        f.wait_workers()
        status, body = http_json(f, "GET", "/readyz")
        assert (status, body["status"]) == (200, "ready"), body
        for w in f.workers:
            if w.stage == "decode":
                w.drain()
                w.join(10)
        deadline = time.monotonic() + 30
        while True:
            status, body = http_json(f, "GET", "/readyz")
            if status == 503:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        assert "decode" in body["error"]["message"], body
    finally:
        f.close()


def test_decode_saves_only_into_its_configured_folder(monkeypatch, tmp_path):
    from mooncake_diffusion.orchestrator.worker import reference as stages

    monkeypatch.delenv(stages.OUTPUTS_ENV, raising=False)
    with pytest.raises(ValueError, match="MCD_OUTPUTS"):
        stages.outputs_folder()
    monkeypatch.setenv(stages.OUTPUTS_ENV, str(tmp_path / "o"))
    assert stages.outputs_folder() == tmp_path / "o" and (tmp_path / "o").is_dir()
    # out_dir in params is not a GenerationParams field and names nothing now
    p = stages.generation_params({"prompt": "p", "out_dir": "/x", "save": True})
    assert p.prompt == "p"


def test_a_default_orchestrator_process_answers_the_front_door_cases():
    """``mooncake-diffusion orchestrator`` with its defaults (its own ports aside): no
    Content-Type, a foreign Host and ``params.out_dir`` are 4xx, and the OpenAI route's
    error carries ``error.message``; the process exits cleanly."""
    from servicestack import CLI, Proc, free_port

    api, workers = free_port(), free_port()
    proc = Proc([*CLI, "orchestrator", "--port", str(api), "--worker-port", str(workers)])
    try:
        url = proc.started(r"orchestrator ready: api (\S+)").group(1)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        cases = [
            fd.Case("no content-type", "POST", "/v1/requests", b'{"params": {}}', {}, 415),
            fd.Case("foreign Host", "GET", "/v1/cluster", host="evil.example", want=421),
            fd._post("out_dir", "/v1/requests", {"params": {"out_dir": "/tmp"}}, 400),
            fd._post("n=0", "/v1/images/generations", {"prompt": "p", "n": 0}, 400),
        ]
        for c in cases:
            status, body = fd.send(host, int(port), c, 30)
            assert status == c.want, (c.name, status, body)
            assert body["error"]["message"], (c.name, body)
    finally:
        assert proc.terminate() == 0

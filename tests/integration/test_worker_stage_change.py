"""Elastic pools through the service and real StageWorkers (threads, loopback sockets,
the in-memory transport, toy stages): a worker that holds every stage, a stage
change (``reassign`` -> ``Load`` -> ``Hello`` again), and a drain, from the service
(``drain``) and from the worker itself (``drain()``, what SIGTERM calls), moving a
denoise job held mid-run. The real-process runs over Mooncake are in
tests/faults/test_elastic_processes.py."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
from apistack import Stack
from gated import held

from mooncake_diffusion.orchestrator.service.service import RequestRejected
from mooncake_diffusion.orchestrator.worker import toy

pytestmark = pytest.mark.integration


@pytest.fixture
def stack():
    s = Stack(heartbeat_timeout=30.0)
    yield s
    s.close_released()


def checksum(st: dict) -> float:
    return json.loads(base64.b64decode(st["output"]))["checksum"]


def worker_view(stack: Stack, wid: str) -> dict | None:
    return next((w for w in stack.svc.cluster()["workers"] if w["worker_id"] == wid), None)


def wait_serving(stack: Stack, wid: str, stages: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        w = worker_view(stack, wid)
        if w is not None and w["state"] == "serving" and w["stages"] == stages:
            return
        assert time.monotonic() < deadline, w
        time.sleep(0.02)


def run_requests(stack: Stack, n: int) -> None:
    params = [{"prompt": f"p{i}", "size": 64, "steps": 3} for i in range(n)]
    rids = [stack.client.submit(p) for p in params]
    for rid, p in zip(rids, params, strict=True):
        st = stack.client.wait(rid, timeout=60)
        assert st["state"] == "completed" and not st.get("reasons"), st
        assert checksum(st) == pytest.approx(toy.expected_checksum(p))


def test_a_worker_that_holds_every_stage_serves_requests_alone(stack):
    w = stack.worker("encode", extra_stages={"denoise": toy.denoise, "decode": toy.decode})
    assert w.stages == ("encode", "denoise", "decode")
    assert worker_view(stack, w.worker_id)["stages"] == ["encode", "denoise", "decode"]
    run_requests(stack, 3)
    assert w.items_done == 9  # every stage of every request, on one worker


def test_a_stage_change_loads_the_new_stage_and_serves_it(stack):
    loaded: list[str] = []
    go = threading.Event()

    def loader(stage: str):  # held until the test lets the load finish
        loaded.append(stage)
        assert go.wait(30)
        return getattr(toy, stage)

    stack.worker("encode")
    stack.worker("denoise")
    flex = stack.worker("denoise", worker_id="flex", loader=loader)
    with pytest.raises(RequestRejected) as e:
        stack.svc.reassign("ghost", ("decode",))
    assert e.value.code == "unknown_worker"
    with pytest.raises(RequestRejected) as e:  # over HTTP: 404
        stack.client.drain("ghost")
    assert e.value.code == "unknown_worker" and "404" in e.value.reason
    assert stack.client.reassign("flex", ["decode"], "mix moved") in ("changing", "loading")
    with pytest.raises(RequestRejected) as e:  # over HTTP: 409, it is loading already
        stack.client.reassign("flex", ["encode"])
    assert e.value.code == "not_serving" and "409" in e.value.reason
    assert worker_view(stack, "flex")["state"] == "loading"
    go.set()
    wait_serving(stack, "flex", ["decode"])
    assert loaded == ["decode"] and flex.stages == ("decode",)
    change = stack.svc.cluster()["stage_changes"][-1]
    assert change["worker_id"] == "flex" and change["stages"] == ["decode"]
    assert change["load_s"] == flex.load_seconds[-1] >= 0.0
    assert stack.svc.cluster()["counters"]["stage_changes"] == 1
    run_requests(stack, 3)  # decode runs on the moved worker: the only one that holds it


class Hold:
    """A denoise held after step 1 until the orchestrator asks it to yield."""

    def __init__(self) -> None:
        self.reached = threading.Event()

    def __call__(self, ctx, _k: int) -> None:
        self.reached.set()
        deadline = time.monotonic() + 30
        while not ctx.should_yield and time.monotonic() < deadline:
            time.sleep(0.005)


@pytest.mark.parametrize("how", ["service", "worker"])
def test_a_drained_worker_hands_its_denoise_job_over_and_exits(stack, how):
    hold = Hold()
    stack.worker("encode")
    stack.worker("decode")
    d0 = stack.worker("denoise", held(toy.denoise, 1, hold), worker_id="d0")
    p = {"prompt": "long", "size": 64, "steps": 6}
    rid = stack.client.submit(p)
    assert hold.reached.wait(30)  # d0 runs the job, held after step 1
    stack.worker("denoise", worker_id="d1")
    if how == "service":  # a planner's scale-down
        assert stack.svc.drain("d0", "scale-down") == "draining"
    else:  # SIGTERM: the worker says it leaves
        d0.drain()
    st = stack.client.wait(rid, timeout=60)
    assert st["state"] == "completed" and not st.get("reasons"), st  # a move is not a failure
    assert checksum(st) == pytest.approx(toy.expected_checksum(p))
    kinds = [(e["kind"], e.get("worker_id")) for e in st["events"] if e.get("stage") == "denoise"]
    assert ("yielded", "d0") in kinds and ("done", "d1") in kinds, kinds
    d0.join(30)  # it exits by itself once it holds nothing (Retire, or its own Bye)
    assert d0._thread is not None and not d0._thread.is_alive()
    assert worker_view(stack, "d0") is None
    assert stack.svc.cluster()["counters"].get("drained") == 1


def test_a_hello_while_loading_does_not_register_the_stages_it_still_holds(stack):
    """A worker told to Load says Hello with its new stages and ``load_s`` once loaded.
    Another Hello meanwhile (after a refusal, or to a new leader: the stages it still
    holds, no ``load_s``) was taken as that registration: the worker came back
    serving its old stages and the real one after loading was only a heartbeat."""
    import zmq

    from mooncake_diffusion.orchestrator.link.wire import (
        Bye,
        Hello,
        Load,
        Welcome,
        decode_from_service,
        encode,
    )

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"flex")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.svc.worker_address)

    def next_of(kind: type) -> object:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sock.poll(1000):
                msg = decode_from_service(sock.recv())
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind.__name__} within 30 s")

    try:
        sock.send(encode(Hello("flex", "encode")))
        next_of(Welcome)
        assert stack.svc.reassign("flex", ("denoise",)) == "loading"  # holds nothing
        next_of(Load)
        sock.send(encode(Hello("flex", "encode", fresh=False)))  # still loading
        next_of(Welcome)
        view = worker_view(stack, "flex")
        assert view is not None and view["state"] == "loading", view
        sock.send(encode(Hello("flex", "denoise", fresh=False, stages=("denoise",), load_s=0.1)))
        next_of(Welcome)
        view = worker_view(stack, "flex")
        assert view is not None and (view["state"], view["stages"]) == ("serving", ["denoise"]), (
            view
        )
        sock.send(encode(Bye("flex", "done")))
    finally:
        sock.close()
        ctx.term()

"""A service whose process froze in the middle of a driver turn keeps its live
workers (``orchestrator/service/stalls.py``). The fault is held where it must land: the
driver's handling of a worker's heartbeat stands for the turn, and at its start
the time the service reads jumps 30 s, past the 10 s heartbeat timeout, as it
would across a SIGSTOP there (the watch and the clock read the same jumping
source; a real stop cannot be placed inside a turn from outside the process).
``tests/faults/test_driver_stall.py`` stops the real process, wherever it is.
A real service, two workers speaking the wire protocol on real DEALER sockets."""

from __future__ import annotations

import time

import pytest
import zmq

from helpers import driven, from_service
from mooncake_diffusion.orchestrator import OrchestratorConfig
from mooncake_diffusion.orchestrator.core.clock import StallClock
from mooncake_diffusion.orchestrator.link.wire import Beat, Hello, Welcome, encode
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration

HEARTBEAT_S = 10.0
FROZEN_S = 30.0


@pytest.mark.parametrize("mode", ["thread", "loop"])
def test_a_freeze_inside_a_turn_is_out_of_that_turn_s_time(mode):
    """(``mode``: the driver a thread, or turning on an asyncio loop.)"""
    baseline = thread_names()
    jump = [0.0]

    def source() -> float:
        return time.monotonic() + jump[0]

    cfg = ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=HEARTBEAT_S),
        worker_bind="tcp://127.0.0.1:0",
    )
    svc = OrchestratorService(cfg, clock=StallClock(source))
    with driven(svc, mode):
        frozen_in_a_turn(svc, jump)
    assert_no_leaks(None, baseline)


def frozen_in_a_turn(svc: OrchestratorService, jump: list[float]) -> None:
    ctx = zmq.Context()
    socks = {}
    try:
        for wid, stage in (("enc", "encode"), ("den", "denoise")):
            sock = socks[wid] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, wid.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(svc.worker_address)
            sock.send(encode(Hello(wid, stage, credits=1)))
            assert from_service(sock, Welcome) is not None, f"{wid} was not welcomed"

        handled, on_frame = [], svc._on_frame

        def frozen_then_handled(ident, frame):  # type: ignore[no-untyped-def]
            if not handled:
                jump[0] = FROZEN_S  # nothing of the process ran for 30 s, as it reads
            handled.append(ident)
            on_frame(ident, frame)

        svc._on_frame = frozen_then_handled  # type: ignore[method-assign]
        socks["enc"].send(encode(Beat("enc")))
        deadline = time.monotonic() + 30
        while not handled:
            assert time.monotonic() < deadline, "the beat was not handled"
            time.sleep(0.01)
        view = svc.cluster()
        assert {w["worker_id"]: w["state"] for w in view["workers"]} == {
            "enc": "serving",
            "den": "serving",
        }, view
        assert view["counters"].get("workers_removed", 0) == 0, view["counters"]
        assert view["counters"]["driver_stall_ms"] >= (FROZEN_S - 1) * 1000, view["counters"]
    finally:
        for sock in socks.values():
            sock.close()
        ctx.term()

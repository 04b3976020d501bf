"""A worker that receives a newer attempt of an item it is still running (the
orchestrator re-queued the old one: missed heartbeats on a loaded machine, or a
restart) withdraws the stale attempt's output instead of failing the new one
on a duplicate publish. The orchestrator is played by hand over the real wire
(ZeroMQ, msgspec frames); the worker is the real ``StageWorker``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from mooncake_diffusion.connector import DiffusionConnector
from mooncake_diffusion.errors import PayloadGoneError
from mooncake_diffusion.orchestrator.model import WorkItem
from mooncake_diffusion.orchestrator.wire import (
    Done,
    Failed,
    Hello,
    Release,
    Welcome,
    Work,
    decode_from_worker,
    encode,
)
from mooncake_diffusion.orchestrator.worker import StageWorker
from mooncake_diffusion.payload import StagePayload
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.transports.memory import fabric_keys

pytestmark = pytest.mark.integration


def item(attempt: int) -> WorkItem:
    return WorkItem("r1", "encode", attempt, "interactive", 0.0, b"{}", b"", {})


def test_a_newer_attempt_withdraws_the_stale_attempts_output():
    gates = {1: threading.Event(), 2: threading.Event()}

    def fn(it: WorkItem, ctx) -> StagePayload:
        assert gates[it.attempt].wait(30), "never released"
        x = np.full(16, it.attempt, np.float32)
        return StagePayload("r1", "embedding", tensor=x, lease="retained")

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn = DiffusionConnector("encode", "memory", MooncakeSettings())
    worker = StageWorker("encode", fn, f"tcp://127.0.0.1:{port}", worker_id="w", connector=conn)
    started = threading.Thread(target=worker.start)
    started.start()

    def recv(kind: type, timeout_ms: int = 30_000):
        while router.poll(timeout_ms):
            wid, frame = router.recv_multipart()
            msg = decode_from_worker(frame)
            if isinstance(msg, kind | Failed):
                return wid, msg
        raise AssertionError(f"no {kind.__name__} from the worker")

    try:
        wid, _ = recv(Hello)
        router.send_multipart([wid, encode(Welcome("w", 0.2))])
        started.join(30)
        router.send_multipart([wid, encode(Work(item(1)))])
        router.send_multipart([wid, encode(Work(item(2)))])  # attempt 1 re-queued meanwhile
        gates[1].set()  # the stale attempt finishes and publishes first
        _, first = recv(Done)
        assert isinstance(first, Done) and first.item.attempt == 1, first
        gates[2].set()
        _, second = recv(Done)
        assert isinstance(second, Done) and second.item.attempt == 2, second
        with pytest.raises(PayloadGoneError):  # attempt 1's output was withdrawn
            conn.consume(first.output, timeout=1)
        with conn.consume(second.output) as got:
            assert np.asarray(got.tensor).tolist() == [2.0] * 16
        router.send_multipart([wid, encode(Release("r1"))])  # the request ended
        deadline = time.monotonic() + 30  # the worker handles it on its loop thread
        while fabric_keys() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fabric_keys() == []  # the Release withdrew attempt 2's output
    finally:
        gates[1].set()
        gates[2].set()
        worker.stop()
        router.close()
        ctx.term()
        conn.cleanup("r1")  # on failure too: the memory fabric is shared by later tests
        conn.close()

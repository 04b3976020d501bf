"""A worker handed a newer attempt of a (request, stage) it already ran: the orchestrator
gave up on the older attempt (the worker was cut off past its heartbeat deadline, as in
the chaos tier's denoise partition) and re-dispatched it, possibly to this same worker
once it is back. The new attempt must run and publish; the older attempt's publication
must not block it (it used to: ``DuplicatePublishError``, and the request failed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from helpers import from_service
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.link.wire import (
    Beat,
    Done,
    Failed,
    Hello,
    Release,
    Welcome,
    Work,
    decode_from_service,
    decode_from_worker,
    encode,
)
from mooncake_diffusion.orchestrator.worker.runtime import StageWorker
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import StagePayload
from mooncake_diffusion.transfer.transports.memory import fabric_keys

pytestmark = pytest.mark.integration


def _item(attempt: int) -> WorkItem:
    return WorkItem("r1", "denoise", attempt, "standard", 0.0, b"{}", b"", {})


def _recv(sock: zmq.Socket, kinds: tuple[type, ...]) -> object:
    """The next message of one of ``kinds`` (beats and progress are skipped)."""
    assert sock.poll(20_000), "the worker said nothing"
    while True:
        ident, frame = sock.recv_multipart()
        msg = decode_from_worker(frame)
        if isinstance(msg, kinds):
            return ident, msg
        assert sock.poll(20_000), "the worker said nothing"


def _journaled(tmp_path, heartbeat_timeout: float):
    """A service config on a free loopback port with a SQLite journal in ``tmp_path``."""
    from servicestack import free_port

    from mooncake_diffusion.orchestrator import OrchestratorConfig
    from mooncake_diffusion.orchestrator.service.service import ServiceConfig

    return ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=heartbeat_timeout),
        worker_bind=f"tcp://127.0.0.1:{free_port()}",
        journal=str(tmp_path / "orchestrator.db"),
    )


def _pipeline_workers(ctx: zmq.Context, bind: str) -> dict[str, zmq.Socket]:
    """Bare worker sockets ``enc``, ``den``, ``dec`` (the test speaks for them)."""
    socks = {}
    for wid in ("enc", "den", "dec"):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, wid.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(bind)
        socks[wid] = s
    return socks


def _close_all(svc, socks: dict[str, zmq.Socket], ctx: zmq.Context) -> None:
    svc.close()
    for s in socks.values():
        s.close()
    ctx.term()


@pytest.mark.parametrize("older", ["finished", "running"])
def test_a_newer_attempt_replaces_what_the_older_one_published(older):
    gate = threading.Event()
    calls: list[int] = []

    def fn(item: WorkItem, ctx) -> StagePayload:
        calls.append(item.attempt)
        if older == "running" and item.attempt == 1:
            gate.wait(20)  # still running when attempt 2 arrives
        x = torch.full((4, 4), float(item.attempt))
        return StagePayload(item.request_id, "latent", tensor=x, lease="retained")

    ctx = zmq.Context()
    svc = ctx.socket(zmq.ROUTER)
    svc.setsockopt(zmq.LINGER, 0)
    port = svc.bind_to_random_port("tcp://127.0.0.1")
    conn = DiffusionConnector("denoise", "memory", MooncakeSettings())
    # the request's input, published upstream: superseding an attempt must leave it
    upstream = DiffusionConnector("encode", "memory", MooncakeSettings())
    emb = upstream.publish(StagePayload("r1", "embedding", tensor=torch.ones(4), lease="retained"))
    w = StageWorker("denoise", fn, f"tcp://127.0.0.1:{port}", worker_id="w", connector=conn)
    t = threading.Thread(target=w._run_safely)
    t.start()
    try:
        ident, _hello = _recv(svc, (Hello,))
        svc.send_multipart([ident, encode(Welcome("w", 0.5))])
        svc.send_multipart([ident, encode(Work(_item(1)))])
        if older == "finished":
            _, done1 = _recv(svc, (Done, Failed))
            assert isinstance(done1, Done), done1  # its result: refused as stale upstream
        svc.send_multipart([ident, encode(Work(_item(2)))])
        gate.set()
        _, res = _recv(svc, (Done, Failed))
        assert isinstance(res, Done) and res.item.attempt == 2, res
        assert calls[-1] == 2
        keys = fabric_keys()
        assert len(keys) == 2 and any("/latent/" in k for k in keys), keys  # input + attempt 2
        emb.release()
        svc.send_multipart([ident, encode(Release("r1"))])
        deadline = time.monotonic() + 10
        while fabric_keys() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fabric_keys() == []  # the request's end drops attempt 2's output
    finally:
        w.drain()
        t.join(30)
        svc.close()
        ctx.term()
    assert not t.is_alive()
    assert conn.stats().live_publications == 0
    conn.close()
    upstream.close()
    assert fabric_keys() == []


def test_a_stale_result_is_released_not_orphaned():
    """A worker's result for an attempt the service re-queued (it went silent past its
    heartbeat deadline) is refused; what it published has no consumer, so the service
    has it dropped: at the request's end, or at once when the request already ended."""
    from mooncake_diffusion.orchestrator import OrchestratorConfig
    from mooncake_diffusion.orchestrator.link.wire import ItemRef, Refused
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
    from mooncake_diffusion.orchestrator.worker import toy

    cfg = ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=0.5), worker_bind="tcp://127.0.0.1:0"
    )
    svc = OrchestratorService(cfg).start()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.ROUTING_ID, b"slow")
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(svc.worker_address)
    conns, workers = [], []
    try:
        rogue.send(encode(Hello("slow", "encode", heartbeat_timeout=0.5)))
        assert rogue.poll(10_000) and isinstance(decode_from_service(rogue.recv()), Welcome)
        rid = svc.submit({"prompt": "late", "steps": 1})
        assert rogue.poll(10_000)
        work = decode_from_service(rogue.recv())
        assert isinstance(work, Work) and work.item.attempt == 1, work
        # silent past the deadline: attempt 1 is re-queued; real workers finish the request
        for stage in ("encode", "denoise", "decode"):
            conn = DiffusionConnector(stage, "memory", MooncakeSettings())
            conns.append(conn)
            w = StageWorker(stage, getattr(toy, stage), svc.worker_address, connector=conn)
            workers.append(w.start())
        assert svc.wait(rid, timeout=60).state == "completed"
        rogue.send(encode(Done("slow", ItemRef(rid, "encode", 1), b"orphan-handle")))
        got = []
        deadline = time.monotonic() + 10
        while not any(isinstance(m, Release) for m in got) and time.monotonic() < deadline:
            if rogue.poll(200):
                got.append(decode_from_service(rogue.recv()))
        assert any(isinstance(m, Refused) and m.code == "stale_attempt" for m in got), got
        assert Release(rid) in got, got
    finally:
        rogue.close()
        ctx.term()
        for w in workers:
            w.drain()
        for w in workers:
            w.join(10)
        svc.close()
        for c in conns:
            c.close()
    assert fabric_keys() == []


def test_a_result_refused_after_an_orchestrator_restart_is_not_shown_done(tmp_path):
    """A worker held an item across an orchestrator restart and stayed silent past the
    restarted service's heartbeat deadline (the downtime itself does not count): the
    service (on its journal) gives that attempt up, so the worker's result, flushed
    as soon as it reconnects, is refused as stale. The client
    must not see the stage done for it, only for the attempt that is taken (the chaos
    tier's orch-restart saw a stage done twice: the refused result, then the re-run)."""
    from servicestack import free_port

    from mooncake_diffusion.orchestrator import OrchestratorConfig
    from mooncake_diffusion.orchestrator.link.wire import ItemRef, Refused
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig

    cfg = ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=1.0),
        worker_bind=f"tcp://127.0.0.1:{free_port()}",
        journal=str(tmp_path / "orchestrator.db"),
    )
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.ROUTING_ID, b"enc")
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(cfg.worker_bind)

    def next_of(kind: type) -> object:
        msg = from_service(rogue, kind)
        assert msg is not None, f"no {kind.__name__} from the service"
        return msg

    svc = OrchestratorService(cfg).start()
    try:
        rogue.send(encode(Hello("enc", "encode")))
        next_of(Welcome)
        rid = svc.submit({"prompt": "held", "steps": 1})
        first = next_of(Work)
        assert first.item.attempt == 1, first
        svc.close()
        svc = OrchestratorService(cfg).start()
        time.sleep(2.5)  # silent for longer than the heartbeat timeout (load only adds)
        rogue.send(encode(Done("enc", ItemRef(rid, "encode", 1), b"")))
        refused = next_of(Refused)
        assert refused.code == "stale_attempt", refused
        kinds = [(e.kind, e.stage) for e in svc.status(rid).events]
        assert ("done", "encode") not in kinds, kinds
        # back with a Hello, the worker gets the new attempt; its result is taken once
        rogue.send(encode(Hello("enc", "encode", fresh=False)))
        again = next_of(Work)
        assert again.item.attempt == 2, again
        rogue.send(encode(Done("enc", ItemRef(rid, "encode", 2), b"")))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            kinds = [(e.kind, e.stage) for e in svc.status(rid).events]
            if ("done", "encode") in kinds:
                break
            time.sleep(0.05)
        assert kinds.count(("done", "encode")) == 1, kinds
    finally:
        svc.close()
        rogue.close()
        ctx.term()
    assert fabric_keys() == []


def test_a_release_that_blocks_does_not_stop_the_heartbeat():
    """A release is a store call in store mode (``connector.cleanup``), which a dead or
    restarting master holds for seconds. The worker runs it off its loop: while the
    cleanup blocks, the beats go on (every 0.2 s here), and it completes afterwards."""
    entered, unblock = threading.Event(), threading.Event()
    cleaned: list[str] = []
    conn = DiffusionConnector("denoise", "memory", MooncakeSettings())
    real = conn.cleanup

    def blocking_cleanup(request_id: str) -> int:
        entered.set()
        unblock.wait(30)
        cleaned.append(request_id)
        return real(request_id)

    conn.cleanup = blocking_cleanup  # type: ignore[method-assign]
    ctx = zmq.Context()
    svc = ctx.socket(zmq.ROUTER)
    svc.setsockopt(zmq.LINGER, 0)
    port = svc.bind_to_random_port("tcp://127.0.0.1")
    w = StageWorker(
        "denoise", lambda item, c: b"", f"tcp://127.0.0.1:{port}", worker_id="w", connector=conn
    )
    t = threading.Thread(target=w._run_safely)
    t.start()
    try:
        ident, _hello = _recv(svc, (Hello,))
        svc.send_multipart([ident, encode(Welcome("w", 0.2))])
        svc.send_multipart([ident, encode(Release("r1"))])
        assert entered.wait(20), "the release never ran"
        for _ in range(3):  # three beats while the cleanup is held (else: "said nothing")
            _recv(svc, (Beat,))
        assert not cleaned
        unblock.set()
        deadline = time.monotonic() + 20
        while not cleaned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cleaned == ["r1"]
    finally:
        unblock.set()
        w.drain()
        t.join(30)
        svc.close()
        ctx.term()
    assert not t.is_alive()
    assert [th.name for th in threading.enumerate() if "release" in th.name] == []
    conn.close()
    assert fabric_keys() == []


def test_releases_a_restart_may_have_lost_are_sent_again(tmp_path):
    """The service commits a request's end, then sends its producers ``Release``; killed
    in between (the chaos tier's orch-restart left a request's embedding and latent in
    the store), the release is lost. A service restarted on the journal sends the
    releases of the requests that ended last again, each to its producer once that
    worker speaks, and none to a worker that produced nothing. Here the first releases
    reach the workers and are ignored, as if lost."""
    from mooncake_diffusion.orchestrator.link.wire import ItemRef
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService

    cfg = _journaled(tmp_path, heartbeat_timeout=30.0)
    ctx = zmq.Context()
    socks = _pipeline_workers(ctx, cfg.worker_bind)

    def take(wid: str, kind: type, within: float = 30.0) -> object | None:
        return from_service(socks[wid], kind, within)

    stages = {"enc": "encode", "den": "denoise", "dec": "decode"}
    svc = OrchestratorService(cfg).start()
    try:
        for wid, stage in stages.items():
            socks[wid].send(encode(Hello(wid, stage)))
            assert take(wid, Welcome) is not None
        rid = svc.submit({"prompt": "released", "steps": 1})
        for wid, stage in stages.items():
            work = take(wid, Work)
            assert work is not None and work.item.stage == stage, work
            out = b"" if stage == "decode" else f"{stage}-handle".encode()
            socks[wid].send(encode(Done(wid, ItemRef(rid, stage, 1), out)))
        assert svc.wait(rid, timeout=30).state == "completed"
        for wid in ("enc", "den"):  # sent once, and dropped here: "lost"
            assert take(wid, Release) == Release(rid)
        svc.close()
        svc = OrchestratorService(cfg).start()
        for wid in stages:
            socks[wid].send(encode(Beat(wid, ())))
        assert take("enc", Release) == Release(rid)
        assert take("den", Release) == Release(rid)
        assert take("dec", Release, within=2.0) is None  # it produced nothing to drop
        assert svc.cluster()["counters"]["releases_resent"] == 2
    finally:
        _close_all(svc, socks, ctx)
    assert fabric_keys() == []


def test_a_restart_longer_than_the_heartbeat_timeout_keeps_the_items_running(tmp_path):
    """The orchestrator was down far longer than the heartbeat timeout while a worker
    held an item. Workers cannot reach a stopped orchestrator, so the downtime is not
    their silence: the restarted service (on its journal) resumes the journal's time,
    keeps the attempt, takes its result and completes the request once, with no
    re-queue, no second attempt and no worker removed. (It used to expire every
    recovered worker at its first recovery heartbeat, re-queue what they held, and
    throw away what that did, so the re-queued items were never sent.) Virtual
    clocks: the second starts 1000 s after the first, no sleeping."""
    from mooncake_diffusion.orchestrator import VirtualClock
    from mooncake_diffusion.orchestrator.link.wire import ItemRef
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService

    cfg = _journaled(tmp_path, heartbeat_timeout=10.0)
    ctx = zmq.Context()
    socks = _pipeline_workers(ctx, cfg.worker_bind)

    def take(wid: str, kind: type, beat: tuple[ItemRef, ...] | None = None) -> object:
        """The next ``kind`` for ``wid``; with ``beat``, beating (listing what it runs)
        every 0.5 s while it waits, as a worker does: a frame sent before its
        connection to a restarted service was up is re-sent after a beat."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if beat is not None:
                socks[wid].send(encode(Beat(wid, beat)))
            msg = from_service(socks[wid], kind, within=0.5 if beat is not None else 30)
            if msg is not None:
                return msg
        raise AssertionError(f"no {kind.__name__} for {wid}")

    stages = {"enc": "encode", "den": "denoise", "dec": "decode"}
    svc = OrchestratorService(cfg, clock=VirtualClock(0.0)).start()
    try:
        for wid, stage in stages.items():
            socks[wid].send(encode(Hello(wid, stage)))
            take(wid, Welcome)
        rid = svc.submit({"prompt": "held", "steps": 1})
        assert take("enc", Work).item.attempt == 1
        socks["enc"].send(encode(Done("enc", ItemRef(rid, "encode", 1), b"encode-handle")))
        held = take("den", Work)  # the denoise worker holds it across the restart
        assert held.item.attempt == 1, held
        svc.close()
        svc = OrchestratorService(cfg, clock=VirtualClock(1000.0)).start()
        ref = ItemRef(rid, "denoise", 1)
        for wid in stages:  # each worker's next beat reaches it, den's with what it runs
            socks[wid].send(encode(Beat(wid, (ref,) if wid == "den" else ())))
        socks["den"].send(encode(Done("den", ref, b"denoise-handle")))
        last = take("dec", Work, beat=())
        assert last.item.attempt == 1, last
        socks["dec"].send(encode(Done("dec", ItemRef(rid, "decode", 1), b"")))
        assert svc.wait(rid, timeout=30).state == "completed"
        events = [(e.kind, e.stage, e.attempt) for e in svc.status(rid).events]
        assert not [e for e in events if e[0] in ("requeued", "rerun", "failed")], events
        assert {e[2] for e in events if e[0] in ("dispatched", "done")} == {1}, events
        for stage in ("denoise", "decode"):  # (the encode's was before the restart)
            assert events.count(("done", stage, 1)) == 1, events
        counters = svc.cluster()["counters"]
        assert counters.get("workers_removed", 0) == 0, counters
        assert counters.get("driver_errors", 0) == 0, counters
        assert counters.get("completed", 0) == 1, counters
    finally:
        _close_all(svc, socks, ctx)
    assert fabric_keys() == []

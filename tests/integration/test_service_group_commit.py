"""Group commit in the service (issue 33): a driver turn's events are one journal
transaction, and nothing the turn produces (a frame to a worker, an API answer)
leaves before that transaction has committed. A real service, a worker speaking
the wire protocol on a real DEALER socket, and the journal's commits logged."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import zmq

from helpers import driven, from_service
from mooncake_diffusion.orchestrator import JournalError, OrchestratorConfig
from mooncake_diffusion.orchestrator.link.wire import (
    Done,
    Hello,
    ItemRef,
    Welcome,
    Work,
    decode_from_service,
    encode,
)
from mooncake_diffusion.orchestrator.service.service import (
    OrchestratorService,
    RequestRejected,
    ServiceConfig,
    ServiceUnavailable,
)

pytestmark = pytest.mark.integration


def _next(sock: zmq.Socket, kind: type, within: float = 30.0) -> object:
    msg = from_service(sock, kind, within)
    assert msg is not None, f"no {kind.__name__} from the service within {within} s"
    return msg


@pytest.fixture(params=["thread", "loop"])
def service(request, tmp_path):
    """A journaled service and a worker ``enc`` (a DEALER socket) it has welcomed;
    its driver a thread, or turning on an asyncio loop (``helpers.driven``)."""
    cfg = ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=60.0),
        worker_bind="tcp://127.0.0.1:0",
        journal=str(tmp_path / "orchestrator.db"),
    )
    svc = OrchestratorService(cfg)
    with driven(svc, request.param):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, b"enc")
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(svc.worker_address)
            yield svc, sock
        finally:
            sock.close()
            ctx.term()


def test_nothing_of_a_turn_leaves_before_its_commit(service):
    svc, sock = service
    log: list[str] = []
    journal = svc._core.journal  # type: ignore[union-attr]
    append, commit, push = journal.append, journal.commit, svc._push_frame

    def logged_append(now, blob):  # type: ignore[no-untyped-def]
        log.append("append")
        return append(now, blob)

    def logged_commit():  # type: ignore[no-untyped-def]
        log.append("commit")
        commit()

    def logged_push(ident, frame):  # type: ignore[no-untyped-def]
        log.append(type(decode_from_service(frame)).__name__)
        push(ident, frame)

    journal.append, journal.commit = logged_append, logged_commit
    svc._push_frame = logged_push  # type: ignore[method-assign]

    sock.send(encode(Hello("enc", "encode", credits=2)))
    _next(sock, Welcome)
    rid = svc.submit({"prompt": "a fox"})
    answered = list(log)  # what had happened when the client got its answer
    work = _next(sock, Work)
    assert work.item.request_id == rid
    sock.send(encode(Done("enc", ItemRef(rid, "encode", 1), b"emb")))
    deadline = time.monotonic() + 30
    while "done" not in [e.kind for e in svc.status(rid).events]:
        assert time.monotonic() < deadline, svc.status(rid)
        time.sleep(0.02)
    # the submit was committed before its answer left the driver
    last_append = max(i for i, x in enumerate(answered) if x == "append")
    assert "commit" in answered[last_append:], answered
    pending = False  # an appended event not yet committed
    for entry in log:
        if entry == "append":
            pending = True
        elif entry == "commit":
            pending = False
        else:
            assert not pending, (entry, log)  # a frame while its event was not durable
    assert {"Welcome", "Work"} <= set(log) and log.count("commit") >= 3, log


def test_a_failed_commit_sends_nothing_of_its_turn_and_stops_the_driver(service):
    svc, sock = service
    sock.send(encode(Hello("enc", "encode", credits=2)))
    _next(sock, Welcome)
    journal = svc._core.journal  # type: ignore[union-attr]

    def full_disk():  # type: ignore[no-untyped-def]
        raise JournalError(f"journal {journal.path}: commit failed: disk full")

    journal.commit = full_disk  # the submit is handled and dispatched, then not durable
    with pytest.raises(ServiceUnavailable, match="journal failed"):
        svc.submit({"prompt": "a fox"})
    assert svc.stopped.wait(10) and isinstance(svc.failure, JournalError)
    assert not sock.poll(300), "a frame of the failed turn reached the worker"


def test_an_awaited_submit_is_one_driver_call_answered_with_its_status(service):
    """The HTTP route's submit: one call to the driver (not a submit, then a status),
    answered with the accepted request's status once the turn has committed."""
    svc, sock = service
    sock.send(encode(Hello("enc", "encode", credits=2)))
    _next(sock, Welcome)
    posted, post = [], svc._post
    log: list[str] = []
    journal = svc._core.journal  # type: ignore[union-attr]
    commit = journal.commit

    def counted_post(fn):  # type: ignore[no-untyped-def]
        posted.append(fn)
        return post(fn)

    def logged_commit():  # type: ignore[no-untyped-def]
        log.append("commit")
        commit()

    svc._post, journal.commit = counted_post, logged_commit  # type: ignore[method-assign]
    st = asyncio.run(svc.submit_async({"prompt": "a fox"}, request_id="fox-1"))
    assert len(posted) == 1 and "commit" in log
    assert st.request_id == "fox-1" and "submitted" in [e.kind for e in st.events]
    assert _next(sock, Work).item.request_id == "fox-1"  # type: ignore[attr-defined]
    with pytest.raises(RequestRejected):
        asyncio.run(svc.status_async("no-such-request"))


@pytest.mark.parametrize("how", ["awaited", "blocking"])
def test_a_call_past_its_timeout_is_unavailable_and_never_runs(service, how):
    """A submit the driver did not start within ``call_timeout_s`` is withdrawn: the
    caller gets ``ServiceUnavailable`` (HTTP 503) and the request is never accepted,
    awaited or blocking (the blocking call left it posted, and the driver ran it once
    it caught up: a request its client never heard of). The driver is held on a
    gate, so the timeout cannot race it."""
    svc, _ = service
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(30)

    svc._post(hold)
    assert held.wait(10)
    patient = svc.config
    svc.config = dataclasses.replace(patient, call_timeout_s=0.2)  # type: ignore[misc]
    try:
        with pytest.raises(ServiceUnavailable, match=r"did not answer within 0\.2 s"):
            if how == "awaited":
                asyncio.run(svc.submit_async({"prompt": "late"}, request_id="late-1"))
            else:
                svc.submit({"prompt": "late"}, request_id="late-1")
    finally:
        gate.set()
        svc.config = patient  # type: ignore[misc]
    assert svc.cluster()["queued"]["encode"] == []  # caught up: the submit did not run
    with pytest.raises(RequestRejected, match="no request"):
        svc.status("late-1")

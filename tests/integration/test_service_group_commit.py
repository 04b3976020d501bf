"""Group commit in the service (issue 33): a driver turn's events are one journal
transaction, and nothing the turn produces (a frame to a worker, an API answer)
leaves before that transaction has committed. A real service, a worker speaking
the wire protocol on a real DEALER socket, and the journal's commits logged."""

from __future__ import annotations

import time

import pytest
import zmq

from mooncake_diffusion.orchestrator import JournalError, OrchestratorConfig
from mooncake_diffusion.orchestrator.service import (
    OrchestratorService,
    ServiceConfig,
    ServiceUnavailable,
)
from mooncake_diffusion.orchestrator.wire import (
    Done,
    Hello,
    ItemRef,
    Welcome,
    Work,
    decode_from_service,
    encode,
)

pytestmark = pytest.mark.integration


def _next(sock: zmq.Socket, kind: type, within: float = 30.0) -> object:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode_from_service(sock.recv())
            if isinstance(msg, kind):
                return msg
    raise AssertionError(f"no {kind.__name__} from the service within {within} s")


@pytest.fixture
def service(tmp_path):
    """A journaled service and a worker ``enc`` (a DEALER socket) it has welcomed."""
    cfg = ServiceConfig(
        orchestrator=OrchestratorConfig(heartbeat_timeout=60.0),
        worker_bind="tcp://127.0.0.1:0",
        journal=str(tmp_path / "orchestrator.db"),
    )
    svc = OrchestratorService(cfg).start()
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
        svc.close()


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

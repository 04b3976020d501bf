"""The orchestrator bench's raw client (``raw_open_loop``) sends what it is told to,
reads every answer on a keep-alive connection, and reports each answer that is not
201 (issue 33). Against a small HTTP/1.1 server on loopback in this process that
answers 201, except 409 for one request id."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_orch", ROOT / "bench" / "orch_load.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class _Submit(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the orchestrator's uvicorn
    seen: ClassVar[list[tuple[str, dict]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, body))
        status = 409 if body["request_id"] == "open-3" else 201
        out = json.dumps({"request_id": body["request_id"]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    """A ThreadingHTTPServer with ``handler`` on a loopback port (yielded), for the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="test-http")
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("rate", [500.0, None], ids=["open-loop", "one-at-a-time"])
def test_raw_client_sends_every_request_and_reports_the_refused(rate):
    baseline = thread_names()
    _Submit.seen = []
    with serving(_Submit) as port:
        sent, failures = bench.raw_open_loop(port, rate, 40, conns=4)
    assert sorted(sent) == sorted(f"open-{i}" for i in range(40))
    assert sorted(b["request_id"] for _, b in _Submit.seen) == sorted(sent)
    assert {p for p, _ in _Submit.seen} == {"/v1/requests"}
    assert all(b["params"] == {"i": int(b["request_id"][5:])} for _, b in _Submit.seen)
    assert len(failures) == 1 and failures[0].startswith("open-3: HTTP/1.1 409")
    assert all(t >= due for due, t in sent.values())  # never sent before it was due
    assert_no_leaks(None, baseline)


class _Idle(_Submit):
    """Closes a connection that sent nothing for ``timeout`` seconds, as uvicorn's
    keep-alive timeout does; counts the connections it was given."""

    timeout = 1.0
    connections: ClassVar[list[int]] = []

    def setup(self) -> None:
        super().setup()
        self.connections.append(1)


def test_raw_client_replaces_connections_the_server_closes_while_idle():
    """At 20/s one connection carries every request (each answered long before the
    next is due, and reused last-in first-out), so the other three sit idle and the
    server closes them after 1 s, and closes their replacements in turn; the run goes
    on and loses nothing (before, the first such close stopped it)."""
    baseline = thread_names()
    _Idle.seen, _Idle.connections = [], []
    with serving(_Idle) as port:
        sent, failures = bench.raw_open_loop(port, 20.0, 50, conns=4)
    assert sorted(sent) == sorted(f"open-{i}" for i in range(50))
    assert sorted(b["request_id"] for _, b in _Idle.seen) == sorted(sent)
    assert len(failures) == 1 and failures[0].startswith("open-3: HTTP/1.1 409")
    assert len(_Idle.connections) > 4  # idle ones were closed and replaced
    assert_no_leaks(None, baseline)

"""The orchestrator bench's model: the pools, policies and fleets it runs, and the
loads it offers the real orchestrator core and service (``bench/orchestrator.py``, the
command, describes each part).

In the order a run uses them:

- ``POLICIES``, ``POOLS``, ``CREDITS``, ``PARTS`` and the workload's constants: what
  ``orch_measure.saturated_all`` and ``orch_measure.chaos`` drive the in-process core
  with; ``FLEET``: the 1,024 stand-in workers of the service part.
- ``fleet_agent``: a child process (``orchestrator.py --fleet-agent``) that registers
  ``FLEET``'s workers of some stages with the service and finishes every item at once;
  ``orch_measure.service_rtt`` starts two per row.
- ``wake_probe``: a child process (``orchestrator.py --wake-probe``) beside the
  diagnostic service row, noting how late the machine wakes it.
- ``raw_open_loop`` and ``library_open_loop``: the two clients that offer the service
  its submissions, open loop; ``service_rtt`` calls one per row.
- ``log``: a line on stderr, for every part.

Imports none of its siblings (tests load it by path alone).
"""

from __future__ import annotations

import json
import sys
import time

POLICIES = ("round_robin", "least_loaded", "affinity")
# workers: encode, denoise, decode. "fleet": 1,344 workers; "xl": 4,096, the largest
# fleet the scheduler is meant to carry on one core.
POOLS = {
    "small": (4, 16, 4),
    "large": (16, 128, 32),
    "fleet": (64, 1024, 256),
    "xl": (256, 3072, 768),
}
CREDITS = {"encode": 4, "denoise": 1, "decode": 4}
#: a saturated run's ``order`` -> its part's name in the log, the tables and the JSON
PARTS = {"oldest": "saturated", "newest": "newest first"}
CHAOS_REQUESTS = 10_000
SERVICE_RATE = 1000.0  # submissions/s offered to the service, open loop
BEAT_SECONDS = 10.0  # each worker's heartbeat period in the saturated part
ITEM_SECONDS = 2.0  # virtual time an item holds its credit in the saturated part
FLEET = {"encode": 64, "denoise": 768, "decode": 192}  # 1,024 registered workers
WAKE_PERIOD_S = 0.002  # the wake probe's sleep: 500 wake-ups/s, about 1 % of a CPU here


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def wake_probe() -> int:
    """A child process: prints ``ready``; once a line comes on stdin, sleeps
    ``WAKE_PERIOD_S`` at a time (a ``select`` on stdin with that timeout) until the
    next line, then prints, as JSON, how late each wake-up came (ms). A process that
    needs almost no CPU is woken late only when the machine is not running it: other
    threads hold both CPUs past their turn, or the hypervisor took the virtual CPU
    away. A round trip through three processes cannot be steadier than that, so the
    diagnostic service row reports it beside its percentiles."""
    import select

    late: list[float] = []
    perf = time.perf_counter
    print("ready", flush=True)
    sys.stdin.readline()
    while True:
        t0 = perf()
        if select.select([sys.stdin], [], [], WAKE_PERIOD_S)[0]:
            sys.stdin.readline()
            break
        late.append((perf() - t0 - WAKE_PERIOD_S) * 1e3)
    print(json.dumps(late), flush=True)
    return 0


def fleet_agent(address: str, out_path: str, stages: str) -> int:
    """A child process: the ``FLEET`` workers of ``stages`` (comma-separated) on one
    thread, one DEALER socket each, that finish every item at once and note when each
    encode item arrived (``time.monotonic``, the same clock in every process). Prints
    ``ready`` once all are welcomed; on a line on stdin it writes the arrival times as
    JSON and exits. The encode workers get a process of their own, so the time
    measured is not that of polling a thousand sockets. Each worker beats once per
    interval at a phase of its own (worker i at i/n of it), as the workers of a fleet
    that joined at different times do, not all at once."""
    import select

    import zmq

    from mooncake_diffusion.orchestrator.link.wire import (
        Beat,
        Done,
        Hello,
        ItemRef,
        Welcome,
        Work,
        decode_from_service,
        encode,
    )

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * sum(FLEET.values()))  # the default is 1,023
    socks: list[tuple[zmq.Socket, str]] = []
    by_fd: dict[int, tuple[zmq.Socket, str]] = {}
    # epoll on each socket's ZMQ_FD, not zmq.Poller: a poll over a thousand sockets
    # costs a walk of all of them per wake-up, which took two thirds of a core here
    # from the service under test. ZMQ_FD only says "look again": each wake-up, and
    # each send, is followed by draining the socket while ZMQ_EVENTS says POLLIN.
    ep = select.epoll()
    for stage, n in FLEET.items():
        if stage not in stages.split(","):
            continue
        for i in range(n):
            wid = f"fleet-{stage}-{i}"
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, wid.encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            labels = {"node": f"n{i % 16}", "rail": str(i % 4)}
            s.send(encode(Hello(wid, stage, CREDITS[stage], labels)))
            socks.append((s, wid))
            fd = s.getsockopt(zmq.FD)
            by_fd[fd] = (s, wid)
            ep.register(fd, select.EPOLLIN)
    ep.register(sys.stdin.fileno(), select.EPOLLIN)
    arrived: dict[str, float] = {}
    welcomed = 0
    interval = 1.0

    def drain(s: zmq.Socket, wid: str) -> None:
        nonlocal welcomed, interval
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = decode_from_service(s.recv())
            if isinstance(msg, Work):
                it = msg.item
                if it.stage == "encode":
                    arrived.setdefault(it.request_id, time.monotonic())
                s.send(encode(Done(wid, ItemRef(it.request_id, it.stage, it.attempt), b"out")))
            elif isinstance(msg, Welcome):
                welcomed += 1
                interval = msg.heartbeat_interval
                if welcomed == len(socks):
                    print("ready", flush=True)

    for s, wid in socks:
        drain(s, wid)
    step = interval / len(socks)
    nxt, next_beat = 0, time.monotonic() + step
    while True:
        for fd, _ in ep.poll(max(0.0, next_beat - time.monotonic())):
            if fd == sys.stdin.fileno():
                sys.stdin.readline()
                with open(out_path, "w") as f:
                    json.dump(arrived, f)
                ep.close()
                for s, _ in socks:
                    s.close()
                ctx.term()
                return 0
            drain(*by_fd[fd])
        now = time.monotonic()
        while now >= next_beat:
            s, wid = socks[nxt]
            s.send(encode(Beat(wid)))
            drain(s, wid)  # a send can take the FD's signal of a frame that came in
            nxt = (nxt + 1) % len(socks)
            next_beat += step


def raw_open_loop(
    port: int, rate: float | None, total: int, conns: int = 16, limit_s: float = 60.0
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """The lean client: ``total`` ``POST /v1/requests`` at ``rate``/s (``None``: one at
    a time) from one thread over ``conns`` keep-alive HTTP/1.1 connections, each
    request pre-built and sent on a connection with no answer pending, stamped just
    before its send. Request ``i`` is due at ``t0 + i / rate`` whatever the answers
    (it waits only when every connection has an answer pending: that is its send
    lag). A connection the server closes while idle (its keep-alive timeout, 5 s by
    default: reused last-in first-out, a few connections carry 1,000/s and the rest
    sit idle) is replaced at once. Returns ``{request id: (due, sent)}`` and one line
    per answer that was not 201. Raises ``TimeoutError`` past ``limit_s`` and
    ``ConnectionError`` when the server closes a connection with an answer pending."""
    import selectors
    import socket

    sel = selectors.DefaultSelector()
    free: list[socket.socket] = []
    bufs: dict[socket.socket, bytes] = {}
    pending: dict[socket.socket, str] = {}

    def connect() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        free.insert(0, s)  # used last: the others are warm
        bufs[s] = b""

    for _ in range(conns if rate else 1):
        connect()
    head = (
        f"POST /v1/requests HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\n"
    ).encode()
    sent: dict[str, tuple[float, float]] = {}
    failures: list[str] = []

    def answers(s: socket.socket) -> None:
        buf = bufs[s]
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            lines = buf[:end].decode("latin-1").split("\r\n")
            length = next(
                (
                    int(v)
                    for k, _, v in (h.partition(":") for h in lines[1:])
                    if k.strip().lower() == "content-length"
                ),
                0,
            )
            if len(buf) < end + 4 + length:
                break
            rid = pending.pop(s)
            if lines[0].split()[1] != "201":
                failures.append(f"{rid}: {lines[0]} {buf[end + 4 : end + 4 + length][:200]!r}")
            buf = buf[end + 4 + length :]
            free.append(s)
        bufs[s] = buf

    i = 0
    closed_idle = 0
    t0 = time.monotonic() + 0.05
    stop = t0 + limit_s
    try:
        while i < total or pending:
            now = time.monotonic()
            if now > stop:
                raise TimeoutError(f"{len(pending)} answers not back within {limit_s:.0f} s")
            due = t0 + i / rate if rate else now
            if i < total and free and now >= due:
                s = free.pop()
                rid = f"open-{i}"
                body = b'{"params":{"i":%d},"request_id":"%s"}' % (i, rid.encode())
                msg = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
                t = time.monotonic()
                s.sendall(msg)
                sent[rid] = (due, t)
                pending[s] = rid
                i += 1
                continue
            wait = max(0.0, due - now) if i < total and free else 1.0
            for key, _ in sel.select(wait):
                s = key.fileobj  # type: ignore[assignment]
                data = s.recv(65536)
                if not data:
                    if s in pending:
                        raise ConnectionError("the orchestrator closed a connection")
                    sel.unregister(s)  # closed while idle: its keep-alive ran out
                    s.close()
                    free.remove(s)
                    del bufs[s]
                    connect()
                    closed_idle += 1
                    continue
                bufs[s] += data
                answers(s)
    finally:
        for s in bufs:
            s.close()
        sel.close()
    if closed_idle:
        log(f"the service closed {closed_idle} idle connections (keep-alive); replaced")
    return sent, failures


def library_open_loop(
    url: str, rate: float | None, total: int
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """The library client: ``OrchestratorClient.submit`` from 8 threads (one when
    ``rate`` is ``None``, each sent when the last was answered), request ``i`` due at
    ``t0 + i / rate``; the threads share one interpreter lock, so a send can wait
    for another thread's Python. Same return as ``raw_open_loop``."""
    import threading

    from mooncake_diffusion.orchestrator.http.client import OrchestratorClient

    sent: dict[str, tuple[float, float]] = {}
    failures: list[str] = []
    lock = threading.Lock()
    nxt = iter(range(total))
    t0 = time.monotonic() + 0.2

    def client_thread() -> None:
        with OrchestratorClient(url) as client:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                due = t0 + i / rate if rate else time.monotonic()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                rid = f"open-{i}"
                t = time.monotonic()
                try:
                    client.submit({"i": i}, request_id=rid)
                except Exception as e:  # reported with the row, not raised mid-run
                    failures.append(f"{rid}: {e!r}"[:300])
                sent[rid] = (due, t)

    threads = [threading.Thread(target=client_thread) for _ in range(8 if rate else 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent, failures

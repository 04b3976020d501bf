"""Front-door bench: abuse cases against a real stack, and the health routes under a flood.

Run ``uv run python bench/front_door.py [--quick] [--json PATH]``. It starts the demo's
stack (``demo.demo_stack``: a real Mooncake master and store host, the orchestrator and
its HTTP API on 127.0.0.1 with an outputs folder, Encode / Denoise / Decode worker
processes running the reference pipeline), then, all on loopback and each bounded:

    abuse      ``abuse_cases()``: raw HTTP requests an attacker or a careless client
               sends (no or wrong Content-Type, a foreign Host or Origin, a path in
               params, a bad request id, chunked / oversized / slow bodies on the JSON
               and the form routes, numbers too long to convert, a seed that overflows,
               an unknown model, a cost over the ceiling, traversal, wrong methods),
               plus the official ``openai`` client on the OpenAI routes. Each case
               checks the status, OpenAI's error shape, and that nothing was left
               behind (queues, running requests, worker credits, store keys; no file
               in the canary folder a request tried to write into). A failed check is a failure.
    cancel     a video denoising (checkpoints saved) is deleted (``DELETE
               /v1/videos/ID``); then the step checkpoints left in the store are counted.
    flood      1,000 idle TCP connections and 50 open event streams, then /healthz and
               /metrics timed one after the other (``--quick``: 20 each, else 100):
               p50 / p99 in ms.
    listeners  TCP listeners of this process and its descendants not on loopback
               (``/proc/PID/net/tcp{,6}``; ``::ffff:127.0.0.1`` is loopback: the
               Transfer Engine's IPv6 listeners under the bind shim take IPv4 loopback
               connections only).

``--quick`` runs the same cases and flood with fewer timed health calls. Exit status 0
when every abuse case passed and no file was written outside the outputs folder.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

J = {"Content-Type": "application/json"}
FORM = "multipart/form-data; boundary=XyZ"


def form(fields: dict[str, str], file: bytes | None = None) -> bytes:
    """A multipart body (boundary ``XyZ``) of ``fields``, with a file part if ``file``."""
    parts = [
        f'--XyZ\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    if file is not None:
        parts.append(
            b'--XyZ\r\nContent-Disposition: form-data; name="input_reference"; '
            b'filename="a.png"\r\nContent-Type: image/png\r\n\r\n' + file + b"\r\n"
        )
    return b"".join(parts) + b"--XyZ--\r\n"


@dataclass
class Case:
    """One raw request and the status it must get. ``chunked``: send the body chunked;
    ``slow``: announce the body's length, send half and stop (the server must time out).
    ``host``: the Host header (None: the server's address)."""

    name: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    want: int = 400
    chunked: bool = False
    slow: bool = False
    host: str | None = None


def _post(name: str, path: str, obj: Any, want: int = 400, **kw: Any) -> Case:
    return Case(name, "POST", path, _j(obj), dict(J), want, **kw)


def _form(name: str, fields: dict[str, str], want: int = 400, **kw: Any) -> Case:
    file = kw.pop("file", None)
    return Case(name, "POST", "/v1/videos", form(fields, file), {"Content-Type": FORM}, want, **kw)


def abuse_cases(canary: Path, max_body: int) -> list[Case]:
    """The catalogue; ``canary``: an existing folder a request asks to write into."""
    req, img, vid = "/v1/requests", "/v1/images/generations", "/v1/videos"
    video = {"prompt": "p", "size": "64x64"}
    huge = {"prompt": "p", "height": 2048, "width": 2048, "frames": 257, "steps": 1000}
    costly = {**video, "size": "2048x2048", "num_frames": 257, "num_inference_steps": 1000}
    text, evil = {"Content-Type": "text/plain"}, {**J, "Origin": "http://evil.example"}
    return [
        Case("no content-type", "POST", req, b'{"params": {}}', {}, 415),
        Case("text/plain", "POST", req, b"{}", text, 415),
        Case("form to the json route", "POST", req, form({"a": "b"}), {"Content-Type": FORM}, 415),
        _post("params.out_dir", req, {"params": {"prompt": "p", "out_dir": str(canary)}}),
        _post("params.output_path", req, {"params": {"output_path": str(canary / "x")}}),
        _post("request id with /", req, {"request_id": "a/b", "params": {}}),
        _post("request id with a newline", req, {"request_id": "a\nb"}),
        _post("request id of 300 chars", req, {"request_id": "r" * 300}),
        Case("foreign Host", "GET", "/healthz", host="evil.example", want=421),
        _post("foreign Host on a POST", req, {}, 421, host="evil.example:80"),
        Case("cross-site Origin", "POST", req, b"{}", evil, 403),
        Case("null Origin", "POST", req, b"{}", {**J, "Origin": "null"}, 403),
        Case("bad json", "POST", req, b"{nope", dict(J)),
        Case("json array", "POST", req, b"[1]", dict(J)),
        Case(
            "length over the limit",
            "POST",
            req,
            b"{}",
            {**J, "Content-Length": str(max_body + 1)},
            413,
        ),
        _post("chunked json", req, {"params": {}}, 411, chunked=True),
        _form("chunked form", video, 411, chunked=True),
        _form("form over the limit", video, 413, file=b"x" * (max_body + 10)),
        _form("form with a file", video, 400, file=b"PNG"),
        _post("slow json body", req, {"params": {"prompt": "p" * 64}}, 408, slow=True),
        _form("slow form body", {**video, "negative_prompt": "n" * 64}, 408, slow=True),
        _post("images n=0", img, {"prompt": "p", "n": 0}),
        _post("size of 5000 digits", img, {"prompt": "p", "size": "9" * 5000 + "x64"}),
        _post("seconds of 5000 digits", vid, {**video, "seconds": "9" * 5000}),
        _form("seconds of 5000 digits (form)", {**video, "seconds": "9" * 5000}),
        _post("seed overflow with n=2", img, {"prompt": "p", "n": 2, "seed": 2**63 - 1}),
        _post("unknown model (images)", img, {"prompt": "p", "model": "gpt-image-9"}, 404),
        _post("unknown model (videos)", vid, {**video, "model": "sora-9"}, 404),
        Case("unknown model (get)", "GET", "/v1/models/sora-9", want=404),
        _post("cost over the ceiling (requests)", req, {"params": huge}),
        _post("cost over the ceiling (videos)", vid, costly),
        Case("traversal", "GET", "/v1/images/..%2F..%2Fetc%2Fpasswd/content", want=404),
        Case("unknown video", "DELETE", "/v1/videos/video_nope", want=404),
        Case("wrong method", "PUT", req, b"{}", dict(J), 405),
        Case("unknown route", "GET", "/v2/anything", want=404),
    ]


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def send(host: str, port: int, case: Case, timeout: float) -> tuple[int, Any]:
    """``case`` over a raw socket; (status, JSON body or the text)."""
    headers = {"Host": case.host or f"{host}:{port}", **case.headers}
    body = case.body or b""
    if case.chunked:
        headers["Transfer-Encoding"] = "chunked"
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    elif case.body is not None:
        headers.setdefault("Content-Length", str(len(body)))
    head = f"{case.method} {case.path} HTTP/1.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "Connection: close\r\n\r\n"
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(head.encode())
        with contextlib.suppress(OSError):  # the server may answer (and close) early
            s.sendall(body[: len(body) // 2] if case.slow else body)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        raw = resp.read()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw[:200].decode(errors="replace")


def shape_problem(status: int, body: Any) -> str | None:
    """Why ``body`` is not OpenAI's error shape, or None."""
    if status < 400:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"not OpenAI's error shape: {str(body)[:120]}"
    if not (isinstance(err.get("message"), str) and err["message"]):
        return "error.message missing"
    if not {"type", "param", "code"} <= set(err):
        return f"error lacks type/param/code: {sorted(err)}"
    return None


def run_cases(
    host: str, port: int, cases: list[Case], state: Callable[[], Any], timeout: float
) -> list[dict[str, Any]]:
    """Each case, with its checks; a row per case (``ok``, ``why``)."""
    rows = []
    for c in cases:
        before = state()
        t = time.perf_counter()
        try:
            status, body = send(host, port, c, timeout)
            why = shape_problem(status, body)
            if status != c.want:
                why = f"status {status}, wanted {c.want}: {str(body)[:160]}"
        except OSError as e:
            status, why = 0, f"{type(e).__name__}: {e}"
        after = state()
        if why is None and after != before:
            why = f"state changed: {before} -> {after}"
        ms = (time.perf_counter() - t) * 1000
        rows.append({"case": c.name, "status": status, "ok": why is None, "why": why, "ms": ms})
    return rows


def openai_cases(url: str, state: Callable[[], Any]) -> list[dict[str, Any]]:
    """The official client on bad input: each must raise with the server's reason in
    ``e.message`` (not just ``Error code: 400``) and leave nothing behind."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    calls: list[tuple[str, Callable[[], Any], str]] = [
        ("openai images n=0", lambda: client.images.generate(prompt="p", n=0), "n"),
        (
            "openai unknown model",
            lambda: client.images.generate(prompt="p", model="gpt-image-9"),
            "gpt-image-9",
        ),
        (
            "openai video size",
            lambda: client.videos.create(prompt="p", size="1x1"),  # type: ignore[arg-type]
            "multiple of 16",
        ),
        ("openai unknown video", lambda: client.videos.retrieve("video_nope"), "video_nope"),
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the client's own (videos)
            rows = _openai_rows(calls, state)
    finally:
        client.close()
    return rows


def _openai_rows(calls: list, state: Callable[[], Any]) -> list[dict[str, Any]]:
    import openai

    rows = []
    for name, call, reason in calls:
        before = state()
        why: str | None = None
        try:
            call()
            why = "no error raised"
        except openai.APIStatusError as e:
            if reason not in e.message or e.message.strip().endswith(str(e.status_code)):
                why = f"e.message lacks the reason: {e.message!r}"
        if why is None and state() != before:
            why = "state changed"
        rows.append({"case": name, "status": 0, "ok": why is None, "why": why, "ms": 0.0})
    return rows


# --------------------------------------------------------------------------- flood
@contextlib.contextmanager
def idle_connections(host: str, port: int, n: int) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=10)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def event_streams(host: str, port: int, rid: str, n: int) -> Iterator[int]:
    """``n`` open ``/events`` streams of ``rid``; yields how many got a 200 head."""
    conns, opened = [], 0
    try:
        for _ in range(n):
            c = http.client.HTTPConnection(host, port, timeout=30)
            c.request("GET", f"/v1/requests/{rid}/events")
            r = c.getresponse()
            opened += r.status == 200
            conns.append(c)
        yield opened
    finally:
        for c in conns:
            c.close()


def timed(host: str, port: int, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        c = http.client.HTTPConnection(host, port, timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"{path} answered {r.status} under the flood")
        finally:
            c.close()
        out.append((time.perf_counter() - t) * 1000)
    return out


def p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.99 * len(xs)) - 1)]


# --------------------------------------------------------------------------- main
@dataclass
class Flood:
    idle: int
    streams_open: int
    healthz_ms: list[float]
    metrics_ms: list[float]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer timed health calls")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    a = p.parse_args(argv)
    from mooncake_diffusion.demo import demo_stack
    from mooncake_diffusion.orchestrator.http.bodies import BODY_TIMEOUT_S, MAX_BODY

    t0 = time.perf_counter()
    timed_calls = 20 if a.quick else 100
    with tempfile.TemporaryDirectory() as tmp:
        canary = Path(tmp) / "canary"
        canary.mkdir()
        with demo_stack(1, Path(tmp) / "stack") as stack:
            svc, host, port = stack.svc, stack.api.host, stack.api.port

            def state() -> Any:
                v = svc.cluster()
                free = sum(w["free"] for w in v["workers"])
                queued = {s: len(q) for s, q in v["queued"].items()}
                return (queued, len(v["running"]), free, len(store_keys(stack)))

            print("abuse cases ...", flush=True)
            rows = run_cases(host, port, abuse_cases(canary, MAX_BODY), state, BODY_TIMEOUT_S + 20)
            rows += openai_cases(stack.api.url, state)
            for r in rows:
                print(f"  {'ok ' if r['ok'] else 'FAIL'} {r['case']}: {r['why'] or r['status']}")
            print("cancel: a denoising video is deleted ...", flush=True)
            leaked, cancel_state = cancel_checkpoints(stack)
            print("flood ...", flush=True)
            flood = flood_health(stack, timed_calls)
            outside = sum(1 for _ in canary.rglob("*"))
            from mooncake_diffusion.testing import non_loopback_listeners

            listeners = non_loopback_listeners(os.getpid())
    total = time.perf_counter() - t0
    summary = {
        "http_abuse_cases": len(rows),
        "http_abuse_failures": sum(not r["ok"] for r in rows),
        "files_written_outside_outputs": outside,
        "non_loopback_listeners": len(listeners),
        "healthz_p99_ms_under_flood": p99(flood.healthz_ms),
        "metrics_p99_ms_under_flood": p99(flood.metrics_ms),
        "healthz_p50_ms_under_flood": statistics.median(flood.healthz_ms),
        "metrics_p50_ms_under_flood": statistics.median(flood.metrics_ms),
        "idle_connections": flood.idle,
        "event_streams_open": flood.streams_open,
        "leaked_checkpoints_after_cancel": leaked,
        "cancelled_state": cancel_state,
    }
    print(json.dumps(summary, indent=2))
    if listeners:
        print("listeners not on loopback:\n  " + "\n  ".join(listeners))
    print(f"total {total:.1f} s")
    if a.json:
        machine = {"cpu_count": os.cpu_count(), "platform": platform.platform()}
        doc = {
            "bench": "front_door",
            "machine": {**machine, "python": platform.python_version()},
            "config": {"quick": a.quick, "timed_calls": timed_calls},
            "rows": rows,
            "flood": asdict(flood),
            "non_loopback": listeners,
            "summary": summary,
            "total_seconds": total,
        }
        Path(a.json).write_text(json.dumps(doc, indent=2))
    return 0 if summary["http_abuse_failures"] == 0 and outside == 0 else 1


def cancel_checkpoints(stack: Any) -> tuple[int, str]:
    """Create a video, wait until it has denoised past a checkpoint, DELETE it; the
    checkpoints left in the store afterwards (counted by removing them)."""
    from mooncake_diffusion.caches.checkpoint import CKPT_ROOT
    from mooncake_diffusion.orchestrator.http.client import OrchestratorClient

    c = http.client.HTTPConnection(stack.api.host, stack.api.port, timeout=30)
    body = _j({"prompt": "a long video", "size": "64x64", "num_frames": 9})
    body = body[:-1] + b', "num_inference_steps": 400}'
    c.request("POST", "/v1/videos", body, J)
    vid = json.loads(c.getresponse().read())["id"]
    client = OrchestratorClient(stack.api.url)
    try:
        deadline = time.monotonic() + 300
        while (client.status(vid).get("step") or 0) < 5:  # checkpoints every 2 steps
            if time.monotonic() > deadline:
                raise RuntimeError(f"{vid} did not reach step 5")
            time.sleep(0.1)
        c.request("DELETE", f"/v1/videos/{vid}")
        c.getresponse().read()
        st = client.wait(vid, timeout=120)
    finally:
        client.close()
        c.close()
    # the worker drops them when it notices the cancel, at its next step boundary
    deadline = time.monotonic() + 10
    while (left := [k for k in store_keys(stack) if k.startswith(CKPT_ROOT)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return len(left), st["state"]


def store_keys(stack: Any) -> list[str]:
    """Every key the stack's Mooncake store holds (the master's admin API)."""
    from mooncake_diffusion._mooncake.master import admin_get

    text = admin_get(stack.settings.admin_address, "/get_all_keys").decode()
    return [k for k in text.splitlines() if k]


def flood_health(stack: Any, n: int) -> Flood:
    """1,000 idle connections and 50 event streams of a running request, then /healthz
    and /metrics timed ``n`` times each."""
    from mooncake_diffusion.orchestrator.http.client import OrchestratorClient

    host, port = stack.api.host, stack.api.port
    client = OrchestratorClient(stack.api.url)
    rid = client.submit(
        {"prompt": "held", "steps": 1000, "height": 64, "width": 64}, slo_class="batch"
    )
    try:
        with idle_connections(host, port, 1000) as idle, event_streams(host, port, rid, 50) as k:
            h = timed(host, port, "/healthz", n)
            m = timed(host, port, "/metrics", n)
            return Flood(len(idle), k, h, m)
    finally:
        client.cancel(rid)
        client.wait(rid, timeout=120)
        client.close()


if __name__ == "__main__":
    sys.exit(main())

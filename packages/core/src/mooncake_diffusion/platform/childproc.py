"""A child process driven by JSON lines: the demo's producer, the caches' test
workers. No pickle: one JSON request line in, one JSON reply line out.

    # parent
    with JsonLinesChild([sys.executable, "-m", "pkg.worker"], settings, "worker") as w:
        reply = w.request(op="publish", ...)   # blocks for the reply line
    # leaving the block sends {"op": "exit"}, waits (kills after 30 s) and reaps

    # child (pkg/worker.py)
    serve_json_lines({"publish": publish, "stats": stats}, sys.stdin, sys.stdout)

The child gets ``settings`` through the environment (``MooncakeSettings.as_env``),
and the bind shim for ``settings.local_hostname`` (``_mooncake.bindshim``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.platform import bindshim
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["JsonLinesChild", "free_port", "free_ports", "serve_json_lines", "terminate"]


class JsonLinesChild:
    """The parent's side; ``request`` is not thread-safe (one exchange at a time)."""

    def __init__(self, argv: list[str], settings: MooncakeSettings, what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **settings.as_env(), **bindshim.env(settings.local_hostname)),
        )

    def request(self, **cmd: Any) -> dict:
        """Send one command and return the child's reply; raises if the child died."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise MooncakeDiffusionError(f"{self.what} exited with code {self.proc.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        """SIGKILL the child (fault tests), then reap it."""
        self.proc.kill()
        self.close()

    def close(self) -> None:
        """Ask the child to exit (killing it after 30 s) and reap it. Idempotent."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> JsonLinesChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_json_lines(
    ops: Mapping[str, Callable[[dict], dict]], stdin: TextIO, stdout: TextIO
) -> None:
    """The child's side: answer each request line with one reply line until
    ``{"op": "exit"}`` or end of input.

    ``ops[op](command)`` returns the reply (with ``"ok": True``). A
    ``MooncakeDiffusionError`` becomes ``{"ok": false, "error": <class name>,
    "message": ...}``, and so does an unknown op; anything else propagates.
    """
    for line in stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "exit":
            return
        handler = ops.get(op)
        try:
            if handler is None:
                reply = {"ok": False, "error": "ValueError", "message": f"bad op {op!r}"}
            else:
                reply = handler(cmd)
        except MooncakeDiffusionError as e:
            reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def terminate(proc: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """SIGTERM ``proc`` and wait, SIGKILL after ``grace_s``; nothing if it is gone."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that is free right now (outside Mooncake's own ranges)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ephemeral TCP ports free right now: all are held until the last
    is found (ports found one at a time and let go may repeat). Another process can
    still take one before its user binds it; a user that must not fail then retries
    on fresh ports."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()

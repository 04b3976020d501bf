"""What the bench scripts share: a peer process driven by JSON lines, a
connector context manager, and the transient-fault retry of raw baselines.
Imported by the scripts in this folder (which run as ``python bench/NAME.py``,
so this folder is on ``sys.path``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch

from mooncake_diffusion import DiffusionConnector, MooncakeSettings
from mooncake_diffusion._mooncake.codes import TRANSIENT


def serve_peer(ops: dict[str, Callable[..., dict[str, Any]]]) -> int:
    """The peer's side: a ``ready`` line, then one JSON reply line per request line.

    ``ops["close"]`` must exist; it ends the loop, and runs anyway if the bench
    goes away without asking. The protocol uses a private copy of stdout, so
    prints from native libraries (which go to fd 1) cannot corrupt it.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    proto.write(json.dumps({"ready": True}) + "\n")
    closed = False
    try:
        for line in sys.stdin:
            req = json.loads(line)
            op = req.pop("op")
            try:
                reply = {"ok": True, **ops[op](**req)}
            except Exception as e:
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            proto.write(json.dumps(reply) + "\n")
            if op == "close":
                closed = True
                break
    finally:
        if not closed:
            ops["close"]()
    return 0


class PeerClient:
    """The bench side of the peer: one JSON request line, one JSON reply line.

    ``argv`` starts the peer (a script calling ``serve_peer``); its stderr is
    kept in a temporary file and its tail is shown if it dies.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self._err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self._ready = False

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited ({self._proc.poll()}); stderr tail:\n{self._tail()}")
        return json.loads(line)

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        if not self._ready:
            self._ready = bool(self._read().get("ready"))
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if not reply.pop("ok"):
            raise RuntimeError(f"peer {op}: {reply['error']}; peer stderr tail:\n{self._tail()}")
        return reply

    def _tail(self, n: int = 2000) -> str:
        self._err.seek(0)
        return self._err.read()[-n:].decode(errors="replace")

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("close")
            with contextlib.suppress(Exception):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.terminate()
                self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._err.close()


@contextlib.contextmanager
def connector(
    role: str, mode: str, settings: MooncakeSettings, *regs: torch.Tensor, **kw: Any
) -> Iterator[DiffusionConnector]:
    """A connector with ``regs`` registered, closed on exit."""
    conn = DiffusionConnector(role, mode, settings, **kw)  # type: ignore[arg-type]
    try:
        for t in regs:
            conn.register(t)
        yield conn
    finally:
        conn.close()


class Unmeasured(RuntimeError):
    """A raw baseline still failed transiently past its deadline: its row is reported
    as not measured, with this text as the reason, and the bench goes on."""


class TransientRetry:
    """Retries a raw Mooncake call while it returns a transient code, as the product's
    ``StoreClient`` does (``codes.TRANSIENT``: a read that outlived its lease, -707, or
    a failed / timed-out master RPC), with backoff 10 ms doubling to 200 ms, until
    ``deadline_s`` after the first try; past it raises ``Unmeasured``. A busy machine
    makes a 256 MiB read outlive its lease; a fair baseline is measured as robustly as
    the product. ``retries`` counts the repeats per call name (time spent retrying is
    in the timed run, as it is in the product's)."""

    def __init__(
        self,
        deadline_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.deadline_s = deadline_s
        self.retries: Counter[str] = Counter()
        self._clock, self._sleep = clock, sleep

    def __call__(self, what: str, call: Callable[[], int]) -> int:
        """``call()``'s first non-transient result (a code or a byte count)."""
        end = self._clock() + self.deadline_s
        delay = 0.01
        while True:
            code = call()
            if code not in TRANSIENT:
                return code
            if self._clock() + delay > end:
                raise Unmeasured(
                    f"{what} still returned Mooncake code {code} after "
                    f"{self.retries[what]} retries within {self.deadline_s:g} s"
                )
            self.retries[what] += 1
            self._sleep(delay)
            delay = min(delay * 2, 0.2)

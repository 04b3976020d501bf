"""The HTTP front in a process of its own (``orchestrator --front-process``).

    front = FrontProcess(service, "127.0.0.1", 7421, token=None, outputs=None,
                         front=FrontConfig())
    front.url; front.check()    # respawns a front that exited
    front.close()

The service's process binds the API's port (so a bad address fails there, and a
respawned front serves the same socket), serves the client API on a
``bridge.BridgeServer`` and starts ``python -m mooncake_diffusion.orchestrator.http.process``
with the listening socket inherited and its settings (``FrontSpec``, JSON) on stdin.
The child serves ``api.build_app`` over a ``remote.RemoteService``: the same routes,
answers and errors as the in-process API, but uvicorn, the middleware and the JSON
work run on another interpreter lock than the driver's. It prints ``front ready``
and exits when its stdin closes (the service closed it, or died); it ignores SIGINT
(the service's process decides when to stop). The token crosses on the pipe, never
on a command line.
"""

from __future__ import annotations

import logging
import select
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.http.api import ApiServer, listen
from mooncake_diffusion.orchestrator.http.front import FrontConfig
from mooncake_diffusion.orchestrator.http.remote import RemoteService
from mooncake_diffusion.orchestrator.service.bridge import BridgeServer
from mooncake_diffusion.orchestrator.service.service import OrchestratorService

__all__ = ["FrontProcess", "FrontSpec"]

log = logging.getLogger("mooncake_diffusion.orchestrator.front")

READY = "front ready"
START_TIMEOUT_S = 60.0


class FrontSpec(msgspec.Struct, frozen=True):
    """What the front's process is told on its stdin (one JSON line)."""

    bridge: str
    fd: int
    host: str
    token: str | None
    outputs: str | None
    front: FrontConfig
    call_timeout_s: float
    v: int = 1


class FrontProcess:
    """The service's API served by a child process (module docstring). Raises
    ``OrchestratorError`` when the port cannot be bound (or a non-loopback host has
    no token) or the child does not start within ``START_TIMEOUT_S``."""

    def __init__(
        self,
        service: OrchestratorService,
        host: str,
        port: int,
        *,
        token: str | None,
        outputs: str | Path | None,
        front: FrontConfig,
    ) -> None:
        self._sock = listen(host, port, token)
        self.host, self.port = self._sock.getsockname()[:2]
        self._bridge: BridgeServer | None = None
        self._proc: subprocess.Popen | None = None
        try:
            self._bridge = BridgeServer(service).start()
            self._spec = FrontSpec(
                bridge=self._bridge.path,
                fd=self._sock.fileno(),
                host=host,
                token=token,
                outputs=None if outputs is None else str(outputs),
                front=front,
                call_timeout_s=service.config.call_timeout_s,
            )
            self._proc = self._spawn()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_diffusion.orchestrator.http.process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(self._sock.fileno(),),
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(msgspec.json.encode(self._spec) + b"\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
            line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        except OSError as e:  # it exited before reading its settings
            line = f"({e})"
        if line != READY:
            _stop(proc)
            raise OrchestratorError(
                f"the HTTP front's process did not start (rc {proc.returncode}, said {line!r})"
            )
        return proc

    def check(self) -> None:
        """Respawn the front if its process exited (it logs why). Raises
        ``OrchestratorError`` if the new one does not start."""
        if self._proc is None or self._proc.poll() is None:
            return
        log.warning(
            "the HTTP front's process exited (rc %s); starting another", self._proc.returncode
        )
        self._proc = self._spawn()

    def close(self) -> None:
        """Stop the front (its stdin closes; killed after 10 s), the bridge and the
        socket. Idempotent. Close the service first so open event streams end."""
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None
        self._sock.close()


def _stop(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    """The front's process: serve the API until stdin closes (module docstring)."""
    import socket

    from mooncake_diffusion.orchestrator.service.gc_tuning import settle_after_startup

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level="WARNING", format="%(asctime)s front %(message)s")
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=FrontSpec)
    remote = RemoteService(spec.bridge, spec.call_timeout_s)
    api = ApiServer(
        remote,  # type: ignore[arg-type]  # the service's client API, over the bridge
        spec.host,
        token=spec.token,
        outputs=spec.outputs,
        front=spec.front,
        sock=socket.socket(fileno=spec.fd),
    )
    try:
        settle_after_startup()
        print(READY, flush=True)
        sys.stdin.buffer.read()  # until the service's process closes it, or dies
    finally:
        api.close()
        remote.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real processes for the orchestrator service tests: `mooncake-diffusion orchestrator`
and `mooncake-diffusion worker`, started, killed and restarted as a user would."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from mooncake_diffusion.orchestrator.http.client import OrchestratorClient
from mooncake_diffusion.platform import bindshim

#: Bounds on waiting for a child to come up or to exit after SIGTERM. They are
#: bounds, not sleeps (a healthy child returns far sooner); generous because a
#: start-up imports torch and Mooncake, which takes minutes on a 2-core machine
#: shared with a CPU hog and other test runs.
START_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 120.0

WORKER_READY = r"worker ready: "

CLI = [sys.executable, "-m", "mooncake_diffusion.cli"]
TOY = "mooncake_diffusion.orchestrator.worker.toy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child whose stdout is read on a thread; ``wait_for(pattern)`` returns a match."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # a child that will not exit is sent SIGABRT: this prints every thread's stack
            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._termed = False
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{self.argv[3:5]}: no line matching {pattern!r}; rc "
                        f"{self.popen.poll()}; output:\n" + "\n".join(self.lines[-40:])
                    )
                self._cv.wait(min(left, 0.2))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        self._reader.join(5)

    def started(self, pattern: str) -> re.Match[str]:
        """``wait_for(pattern)``; if it never comes, kill the child (and its reader
        thread) before raising, so a failed start leaves nothing behind."""
        try:
            return self.wait_for(pattern)
        except AssertionError:
            self.kill()
            raise

    def signal_term(self) -> None:
        """SIGTERM once (a second would be harmless but is not sent)."""
        if self.popen.poll() is None and not self._termed:
            self.popen.send_signal(signal.SIGTERM)
            self._termed = True

    def terminate(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        """SIGTERM (unless ``signal_term`` sent it), then wait up to ``timeout`` for the
        exit code. A child still there is sent SIGABRT (its Python stacks, by
        faulthandler, go to its output, which is printed to stderr for the test report)
        and then SIGKILL; returns its code."""
        self.signal_term()
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGABRT)
            try:
                rc = self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                rc = self.popen.wait(10)
            self._reader.join(5)
            tail = "\n".join(self.lines[-200:])
            print(
                f"{self.argv[3:5]} did not exit {timeout} s after SIGTERM:\n{tail}", file=sys.stderr
            )
        self._reader.join(5)
        return rc


class ServiceStack:
    """An orchestrator process (fixed ports, a journal) and worker processes."""

    def __init__(self, tmp: Path, mooncake_env: dict[str, str], heartbeat_timeout: float = 2.0):
        self.tmp = tmp
        self.env = mooncake_env
        self.heartbeat_timeout = heartbeat_timeout
        self.api_port, self.worker_port = free_port(), free_port()
        self.journal = str(tmp / "orchestrator.db")
        self.orchestrator: Proc | None = None
        self.workers: dict[str, Proc] = {}
        self.client: OrchestratorClient | None = None
        #: names (worker ids, "orchestrator") whose exit code must be 0 at close
        self.clean_exit: tuple[str, ...] = ()
        #: called with the cluster after the processes stopped, before the leak check
        self.after_close: list = []
        #: store key prefixes meant to outlive requests (a cache an ``after_close``
        #: callback clears): the teardown's wait for released payloads ignores them
        self.lasting: tuple[str, ...] = ()

    @property
    def worker_address(self) -> str:
        return f"tcp://127.0.0.1:{self.worker_port}"

    def start_orchestrator(self, *extra: str) -> Proc:
        argv = [
            *CLI,
            "orchestrator",
            "--port",
            str(self.api_port),
            "--worker-port",
            str(self.worker_port),
            "--journal",
            self.journal,
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
            *extra,
        ]
        self.orchestrator = Proc(argv)
        self.orchestrator.started(r"orchestrator ready: api (\S+)")
        if self.client is None:
            self.client = OrchestratorClient(f"http://127.0.0.1:{self.api_port}")
        return self.orchestrator

    def start_worker(
        self,
        stage: str | tuple[str, ...],
        worker_id: str,
        credits: int = 1,
        *,
        fn: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Proc:
        """Start a worker process of ``stage`` (or of several: a tuple, with ``fn`` a
        module that has a function per stage); with ``wait`` (the default) return once
        it is ready, else at once (``ready()`` then waits for every worker started so)."""
        stages = (stage,) if isinstance(stage, str) else stage
        argv = [
            *CLI,
            "worker",
            *(a for s in stages for a in ("--stage", s)),
            "--fn",
            fn or f"{TOY}:{stage}",
            "--orchestrator",
            self.worker_address,
            "--worker-id",
            worker_id,
            "--credits",
            str(credits),
            "--label",
            "node=n0",
        ]
        # its Transfer Engine on the configured host, as the demo starts its workers
        host = self.env.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
        p = Proc(argv, {**self.env, **bindshim.env(host), **(env or {})})
        self.workers[worker_id] = p  # close() stops it even if it never gets ready
        if wait:
            p.started(WORKER_READY)
        return p

    def ready(self) -> None:
        """Wait until every worker is ready (they start side by side: a start is
        mostly imports, and each runs on a core of its own)."""
        for p in self.workers.values():
            p.started(WORKER_READY)

    def close(self) -> dict[str, int]:
        """SIGTERM every worker at once (they drain side by side), then the
        orchestrator once they are gone; their exit codes."""
        for p in self.workers.values():
            p.signal_term()
        rcs = {wid: p.terminate() for wid, p in self.workers.items()}
        if self.orchestrator is not None:
            rcs["orchestrator"] = self.orchestrator.terminate()
        if self.client is not None:
            self.client.close()
        return rcs

"""The real ``sglang serve`` processes of one disaggregated deployment, for tests.

    stack = ServeStack(model, tmp_path, {"decoder": ["--mooncake-diffusion-same-host", "off"]})
    stack.start()                      # head + encoder + denoiser + decoder, ready
    out = stack.generate("small", "req-1")   # sglang's own client protocol, one request
    stack.kill_scheduler("decoder")    # SIGKILL a role's scheduler process
    stack.restart("decoder")           # the role's processes ended, started again, ready
    stack.close()                      # SIGTERM every process group, reap, no orphans

Each process is started exactly as a user starts it, through the ``sglang``
console script with ``--disagg-role``; each role spawns its scheduler through
sglang's worker bootstrap. The test-only plugin in ``fake_worker/`` is on their
``PYTHONPATH`` (and only theirs). Logs go to ``<tmp>/<name>.log``.

A test process ended by SIGTERM or SIGHUP (a CI runner's cancel, ``kill``) would
skip pytest's fixture teardown: the first such signal becomes a
``KeyboardInterrupt`` instead, so pytest tears its fixtures down (each stack's
``close()``), and a stack still live at interpreter exit is closed then, so that
no ``sglang serve`` process (one may be SIGSTOPped mid-test) outlives the test
run and holds its ports and memory for the next one. A second signal ends the
process at once, as the default would.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_worker"
ROLES = ("encoder", "denoiser", "decoder")
START_MAX_S = 900.0  # sglang imports take minutes on a busy 2-core machine
#: the DiffusionServer's own deadline: set far past any test so that a failure the
#: client sees can only come from the failure path, never from this timeout
DISAGG_TIMEOUT_S = 86400
GENERATE_MAX_S = 900.0  # a client's hang guard (never a measured bound)
#: stacks started and not yet closed (closed at exit); the process that installed
#: the signal handlers and which signals it took over
_LIVE: set[ServeStack] = set()
_GUARD: dict[str, Any] = {"pid": 0, "signals": []}


def _close_live() -> None:
    if os.getpid() == _GUARD["pid"]:  # not in a child forked from the test process
        for taken in _GUARD["signals"]:  # a signal now must not cut these closes off
            signal.signal(taken, signal.SIG_IGN)  # (each ends by itself: SIGKILL at 60 s)
        for stack in list(_LIVE):
            stack.close()


def _on_signal(signum: int, _frame: Any) -> None:
    """The first SIGTERM / SIGHUP: a ``KeyboardInterrupt``, so that pytest tears its
    fixtures down; the handlers go back to the default, so a second one ends us."""
    if os.getpid() != _GUARD["pid"]:  # a forked child: end as the default would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    for taken in _GUARD["signals"]:
        signal.signal(taken, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: closing the sglang stacks")


def _guard() -> None:
    """Install the exit hook and, from the main thread (where Python allows it), the
    signal handlers, once per process; a handler someone else installed (SIGHUP
    ignored under ``nohup``) is left alone."""
    if _GUARD["pid"] == os.getpid():
        return
    _GUARD["pid"] = os.getpid()
    atexit.register(_close_live)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _on_signal)
            _GUARD["signals"].append(signum)


def _group_alive(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` is still running (not a zombie)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _free_base(span: int) -> int:
    """A port P with P .. P+span-1 all free (the head binds P+1..P+5 for results)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span >= 65000:
            continue
        ok = True
        for p in range(base, base + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


class ServeStack:
    """One head and one process per role (module docstring)."""

    def __init__(self, model: str, root: Path, roles: dict[str, list[str]] | None = None) -> None:
        self.model = model
        self.root = root
        self.fake_dir = root / "fake"
        self.fake_dir.mkdir(parents=True, exist_ok=True)
        self.extra = roles or {}
        self.head_port = _free_base(8)
        self.http_port = _free_base(1)
        self.role_ports = {r: _free_base(1) for r in ROLES}
        self.procs: dict[str, subprocess.Popen] = {}

    # -- lifecycle ---------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE), env.get("PYTHONPATH")]))
        env["MCD_FAKE_DIR"] = str(self.fake_dir)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("MC_FORCE_TCP", "1")
        return env

    def _spawn(self, name: str, argv: list[str]) -> None:
        sglang = os.path.join(os.path.dirname(sys.executable), "sglang")
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (closed by the child's exit)
        self.procs[name] = subprocess.Popen(
            [sglang, "serve", "--model-path", self.model, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,  # its own process group: close() ends its children too
        )
        log.close()

    def start(self) -> None:
        _guard()
        _LIVE.add(self)
        urls = {r: f"tcp://127.0.0.1:{p}" for r, p in self.role_ports.items()}
        self._spawn(
            "head",
            [
                "--disagg-role", "server",
                "--host", "127.0.0.1",
                "--port", str(self.http_port),
                "--scheduler-port", str(self.head_port),
                "--encoder-urls", urls["encoder"],
                "--denoiser-urls", urls["denoiser"],
                "--decoder-urls", urls["decoder"],
                "--disagg-timeout", str(DISAGG_TIMEOUT_S),
            ],
        )  # fmt: skip
        for role in ROLES:
            self._spawn(role, self._role_argv(role))
        want = {"head": "Starting HTTP server"}
        self._wait_ready({**want, **{r: f"Role {r.upper()} ready" for r in ROLES}})

    def _role_argv(self, role: str) -> list[str]:
        """A role's ``sglang serve`` arguments; its extras come last (they win)."""
        return [
            "--disagg-role", role,
            "--scheduler-port", str(self.role_ports[role]),
            "--disagg-server-addr", f"tcp://127.0.0.1:{self.head_port}",
            "--disagg-transfer-backend", "mooncake-diffusion",
            "--disagg-transfer-pool-size", str(512 << 20),
            *self.extra.get(role, []),
        ]  # fmt: skip

    def restart(self, role: str) -> None:
        """End ``role``'s process group (SIGKILL) and, once none of its processes is
        left, start the role again with the same arguments: a new scheduler, Transfer
        Engine and session. Returns when it is ready; its log starts over."""
        proc = self.procs[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + START_MAX_S  # a hang guard, never a measured bound
        while _group_alive(proc.pid):  # its scheduler holds the role's ports until gone
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {role}'s processes outlived SIGKILL")
            time.sleep(0.05)
        self._spawn(role, self._role_argv(role))
        self._wait_ready({role: f"Role {role.upper()} ready"})

    def _wait_ready(self, want: dict[str, str]) -> None:
        """Wait until each process named in ``want`` logged its line."""
        deadline = time.monotonic() + START_MAX_S
        pending = dict(want)
        while pending:
            for name in list(pending):
                proc = self.procs[name]
                text = self.log(name)
                if pending[name] in text:
                    del pending[name]
                elif proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{text[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {START_MAX_S} s: {sorted(pending)}")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        try:
            return (self.root / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def scheduler_pid(self, role: str) -> int:
        """The pid of a role's scheduler process (written by the fake worker)."""
        return int((self.fake_dir / f"{role}.pid").read_text())

    def kill_scheduler(self, role: str) -> None:
        """SIGKILL a role's scheduler (its Transfer Engine and pool die with it)."""
        os.kill(self.scheduler_pid(role), signal.SIGKILL)

    def close(self) -> None:
        """End every process group (SIGTERM, then SIGKILL) and reap. Idempotent; a
        close cut off (an interrupt) leaves the stack live for the exit hook."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it may end meanwhile
                    os.killpg(proc.pid, signal.SIGTERM)
                    os.killpg(proc.pid, signal.SIGCONT)  # a stopped one acts on it too
        deadline = time.monotonic() + 60
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):  # the group's scheduler children
                os.killpg(proc.pid, signal.SIGKILL)
        _LIVE.discard(self)

    # -- requests ----------------------------------------------------------------
    def generate(self, prompt: str, request_id: str, timeout_s: float = GENERATE_MAX_S) -> Any:
        """One request through the head's frontend with sglang's own client protocol
        (what its HTTP server's ``SchedulerClient`` sends: a pickled ``[Req]``, an
        ``OutputBatch`` back). Blocks until the DiffusionServer answers; raises
        ``TimeoutError`` after ``timeout_s`` (a hang guard: a dead head never answers)."""
        import zmq
        from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

        req = Req(sampling_params=SamplingParams(prompt=prompt, seed=1))
        req.request_id = request_id
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://127.0.0.1:{self.head_port}")
            sock.send(pickle.dumps([req]))
            sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
            try:
                return pickle.loads(sock.recv())
            except zmq.Again:
                raise TimeoutError(f"no answer to {request_id} in {timeout_s} s") from None
        finally:
            sock.close()
            ctx.term()

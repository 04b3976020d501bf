"""``LocalProvisioner``: stage workers as processes on this machine (the demo's and the tests').

    prov = LocalProvisioner(svc.worker_address, env, logs_dir)
    wid = prov.add(("denoise",))        # starts `mooncake-diffusion worker`, returns its id
    prov.remove(wid)                    # SIGTERM (the worker drains and exits); idempotent
    prov.check()                        # raises if a worker exited that nobody removed
    prov.close()                        # stops every worker and waits for it

It implements ``contract.Provisioner``: the planner's ``AddWorker`` starts one more
process (it registers with the orchestrator itself), ``Retire`` ends in
``remove`` once the orchestrator has drained the worker. Each worker runs the
reference pipeline's stage functions by default (``fn``: a module whose
functions are named after the stages, and whose ``load(stage)``, if any, loads
a stage's model on a stage change), logs to ``logs/ID.log`` and gets ``env``
on top of this process's environment (the Mooncake settings and the bind shim,
as ``demo.py`` passes them). Thread-safe: the service's driver thread and its
owner may call it at once. ``add`` returns at once; the worker registers when
it is up (seconds: Python, torch and the model load).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from mooncake_diffusion.orchestrator.core.model import Stage

__all__ = ["REFERENCE_STAGES", "LocalProvisioner"]

#: the reference pipeline's stage functions (``encode``, ``denoise``, ``decode``)
REFERENCE_STAGES = "mooncake_diffusion.orchestrator.worker.reference"
_PREFIX = {"encode": "enc", "denoise": "den", "decode": "dec"}


class LocalProvisioner:
    """See the module docstring. ``credits``: receive slots per stage (default 1);
    ``labels``: every worker's topology labels; ``stop_timeout_s``: how long
    ``close`` waits for a worker after SIGTERM before it kills it."""

    def __init__(
        self,
        address: str,
        env: Mapping[str, str],
        logs: Path,
        *,
        fn: str = REFERENCE_STAGES,
        credits: Mapping[str, int] | None = None,
        labels: Mapping[str, str] | None = None,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.address, self.env, self.logs, self.fn = address, dict(env), Path(logs), fn
        self.credits = dict(credits or {})
        self.labels = dict(labels if labels is not None else {"node": "local"})
        self.stop_timeout_s = stop_timeout_s
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._removed: set[str] = set()

    def argv(self, stages: tuple[Stage, ...], worker_id: str, credits: int) -> list[str]:
        """The command that starts one worker (``mooncake-diffusion worker``): every
        stage's function is ``fn:<stage>``, for its stages now and those a stage
        change moves it to later."""
        argv = [sys.executable, "-m", "mooncake_diffusion.cli", "worker"]
        for stage in stages:
            argv += ["--stage", stage]
        argv += ["--fn", self.fn, "--orchestrator", self.address]
        argv += ["--worker-id", worker_id, "--credits", str(credits)]
        for k, v in self.labels.items():
            argv += ["--label", f"{k}={v}"]
        return argv

    def add(
        self,
        stages: tuple[Stage, ...],
        worker_id: str | None = None,
        credits: int | None = None,
    ) -> str:
        """Start a worker holding ``stages``; its id (``worker_id``, or the first
        stage's prefix and the first free number: ``den-2``)."""
        if not stages:
            raise ValueError("a worker holds at least one stage")
        with self._lock:
            wid = worker_id or self._free_id(stages[0])
            if wid in self._procs:
                raise ValueError(f"worker {wid!r} was started already")
            n = credits if credits is not None else self.credits.get(stages[0], 1)
            self.logs.mkdir(parents=True, exist_ok=True)
            log = open(self.logs / f"{wid}.log", "wb")  # noqa: SIM115 (closed in close())
            try:
                p = subprocess.Popen(
                    self.argv(stages, wid, n),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env},
                )
            except BaseException:
                log.close()
                raise
            self._procs[wid], self._logs[wid] = p, log
            return wid

    def _free_id(self, stage: str) -> str:
        prefix = _PREFIX.get(stage, stage)
        n = 0
        while f"{prefix}-{n}" in self._procs:
            n += 1
        return f"{prefix}-{n}"

    def remove(self, worker_id: str) -> None:
        """Stop ``worker_id`` (SIGTERM: a worker drains what it holds, then exits).
        Returns at once; idempotent; an unknown or exited worker is left as it is."""
        with self._lock:
            p = self._procs.get(worker_id)
            self._removed.add(worker_id)
            if p is not None and p.poll() is None:
                p.terminate()

    def workers(self) -> list[str]:
        """The ids this provisioner started that are still running."""
        with self._lock:
            return [w for w, p in self._procs.items() if p.poll() is None]

    def check(self) -> None:
        """Raise ``RuntimeError`` naming a worker that exited without ``remove``."""
        with self._lock:
            for wid, p in self._procs.items():
                if wid not in self._removed and p.poll() is not None:
                    raise RuntimeError(
                        f"worker {wid} exited with {p.returncode}; see {self.logs / wid}.log"
                    )

    def close(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after ``stop_timeout_s``), wait for
        each and close its log. Idempotent."""
        with self._lock:
            procs, logs = dict(self._procs), dict(self._logs)
            self._removed.update(procs)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()

    def __enter__(self) -> LocalProvisioner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

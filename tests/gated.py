"""Stage functions that hold their work at a known step, so a fault test injects
its fault exactly there instead of polling status and racing the work.

The worker side: run a worker with ``--fn gated:denoise`` (the reference
pipeline's denoise) or ``--fn gated:toy_denoise`` (the toy one) and the
environment of ``Gate.env(step)``. The first time a request's denoise reports
progress ``step`` in any worker of the test, that worker writes a *reached*
file (its worker id) and blocks until the test releases the request, or, with
``until="yield"``, until the orchestrator asks the item to yield (preemption).
Later arrivals at that step (the job resumed elsewhere) pass straight through.

The test side::

    gate = Gate(tmp_path)
    stack.start_worker("denoise", "den-0", fn="gated:denoise", env=gate.env(5))
    rid = client.submit(...)
    at = gate.wait_reached(rid)      # den-0 is inside step 5 of rid, held
    stack.workers[at].kill()         # the fault lands at step 5, every time
    gate.release(rid)                # (or let the held work go on)

Files, not signals, so it works across processes with nothing else shared; a
held stage gives up after ``HOLD_MAX_S`` so a broken test cannot hang a worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mooncake_diffusion.orchestrator import toy
from mooncake_diffusion.pipeline import stages

__all__ = ["Gate", "denoise", "held", "toy_denoise"]

DIR_ENV = "MCD_TEST_GATE_DIR"
STEP_ENV = "MCD_TEST_GATE_STEP"
UNTIL_ENV = "MCD_TEST_GATE_UNTIL"
HOLD_MAX_S = 300.0
_POLL_S = 0.005


def _reached(root: Path, rid: str) -> Path:
    return root / f"{rid}.reached"


def _released(root: Path, rid: str) -> Path:
    return root / f"{rid}.released"


def _hold(ctx: Any, step: int) -> None:
    """Called after the stage reported ``step``: hold there if this is the first arrival."""
    root, until = Path(os.environ[DIR_ENV]), os.environ.get(UNTIL_ENV, "release")
    rid = ctx.item.request_id
    try:
        fd = os.open(_reached(root, rid), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # held once already (this is the job resumed after the fault)
    with os.fdopen(fd, "w") as f:
        json.dump({"worker_id": ctx.worker_id, "step": step, "pid": os.getpid()}, f)
    deadline = time.monotonic() + HOLD_MAX_S
    while time.monotonic() < deadline:
        if _released(root, rid).exists() or ctx.cancelled:
            return
        if until == "yield" and ctx.should_yield:
            return
        time.sleep(_POLL_S)


def held(fn: Any, step: int, hold: Any) -> Any:
    """Stage function ``fn`` with ``hold(ctx, step)`` called (in the stage's thread)
    right after it reports progress ``step``; ``hold`` blocks as long as it likes.
    In-process tests pass their own ``hold`` (e.g. wait on a ``threading.Event``)."""

    def run(item: Any, ctx: Any) -> Any:
        if step > 0:
            report = ctx.progress

            def progress(k: int, total: int) -> None:
                report(k, total)
                if k == step:
                    hold(ctx, k)

            ctx.progress = progress
        return fn(item, ctx)

    return run


def _gated(fn: Any) -> Any:
    def run(item: Any, ctx: Any) -> Any:
        return held(fn, int(os.environ.get(STEP_ENV, "0")), _hold)(item, ctx)

    run.__doc__ = f"{fn.__module__}.{fn.__name__}, held at step ${STEP_ENV} (see module doc)"
    return run


denoise = _gated(stages.denoise)
toy_denoise = _gated(toy.denoise)


class Gate:
    """The test's side of the gate, on a directory of its own (e.g. ``tmp_path``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "gate"
        self.root.mkdir(parents=True, exist_ok=True)

    def env(self, step: int, until: str = "release") -> dict[str, str]:
        """Worker environment: hold each request at ``step`` until ``release()``
        (``until="release"``) or until the item is asked to yield (``"yield"``)."""
        assert until in ("release", "yield"), until
        return {
            DIR_ENV: str(self.root),
            STEP_ENV: str(step),
            UNTIL_ENV: until,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }

    def wait_reached(self, rid: str, timeout: float = 180.0) -> str:
        """Block until a worker holds ``rid`` at the gate; that worker's id."""
        path = _reached(self.root, rid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return json.loads(path.read_text())["worker_id"]
            except (FileNotFoundError, ValueError):  # not there, or being written
                time.sleep(0.01)
        raise AssertionError(f"{rid} never reached the gate within {timeout}s")

    def release(self, rid: str) -> None:
        """Let ``rid`` go on from the gate (no-op if it was never held)."""
        _released(self.root, rid).touch()

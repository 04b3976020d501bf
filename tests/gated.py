"""Stage functions that hold their work at a known point, so a fault test injects
its fault exactly there instead of polling status and racing the work. One helper
for the fault tests (``tests/faults``) and the chaos tier (``tests/chaos``).

The worker side: run a worker with ``--fn gated:STAGE`` (``encode``, ``denoise``,
``decode``: the reference pipeline's; ``toy_denoise``: the toy one) and the
environment of ``Gate.env(...)`` (it puts this folder on ``PYTHONPATH``). A
request's stage holds where the test asked:

- per request: ``Gate.hold(rid, stage, k)`` before submitting. Denoise holds right
  after it reports progress step ``k`` (``k == 0``: before it consumed its input);
  decode after ``k`` latent chunks; encode before it runs; ``serve`` (not a stage:
  a p2p producer serving one of the request's payloads) before it writes chunk ``k``;
- for every request's denoise: ``Gate.env(step)``, the step to hold at.

Every start of a gated stage is noted (``Gate.ran()``: request, stage, attempt,
time), so a test can check each item a worker ran against what the orchestrator
committed to dispatching.

``failing_denoise`` is ``denoise`` that, after the gate (if any), raises a retryable
error right after step ``Gate.env(fail=k)`` on every attempt: the request fails for
good once its attempts are spent, with the checkpoints of the steps before ``k`` saved.

The first arrival at the point, in any worker of the test, writes a *reached*
file (worker id, step, pid, time) and blocks until the test releases it, or, with
``until="yield"``, until the orchestrator asks the item to yield (preemption), or
the item is cancelled. Later arrivals (the job resumed or re-run elsewhere) pass
straight through.

The test side::

    gate = Gate(tmp_path)
    stack.start_worker("denoise", "den-0", fn="gated:denoise", env=gate.env(5))
    rid = client.submit(...)
    at = gate.wait_reached(rid)      # den-0 is inside step 5 of rid, held
    stack.workers[at].kill()         # the fault lands at step 5, every time
    gate.release(rid)                # (or let the held work go on)

Files, not signals, so it works across processes and namespaces with nothing else
shared; a held stage gives up after ``HOLD_MAX_S`` so a broken test cannot hang a
worker.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mooncake_diffusion.orchestrator.worker import reference as stages
from mooncake_diffusion.orchestrator.worker import toy

__all__ = [
    "Gate",
    "decode",
    "denoise",
    "encode",
    "failing_denoise",
    "held",
    "load",
    "toy_denoise",
]

DIR_ENV = "MCD_TEST_GATE_DIR"
STEP_ENV = "MCD_TEST_GATE_STEP"
UNTIL_ENV = "MCD_TEST_GATE_UNTIL"
FAIL_ENV = "MCD_TEST_FAIL_STEP"
HOLD_MAX_S = 300.0
_POLL_S = 0.005


def _file(root: Path, rid: str, stage: str, what: str) -> Path:
    return root / f"{rid}.{stage}.{what}"


# ------------------------------------------------------------------ worker side
def _root() -> Path | None:
    d = os.environ.get(DIR_ENV)
    return Path(d) if d else None


def _asked(rid: str, stage: str) -> tuple[int, str] | None:
    """(point, until) where ``rid``'s ``stage`` holds, or None: the request's own hold
    file, else (denoise only) the environment's step."""
    root = _root()
    if root is None:
        return None
    own = _file(root, rid, stage, "hold")
    if own.exists():
        spec = json.loads(own.read_text())
        return int(spec["step"]), str(spec.get("until", "release"))
    step = int(os.environ.get(STEP_ENV, "0"))
    if stage == "denoise" and step > 0:
        return step, os.environ.get(UNTIL_ENV, "release")
    return None


def _ran(item: Any) -> None:
    """Note that this process started ``item`` (``Gate.ran``): one line per start, in a
    file of its own pid, appended whole (one write)."""
    root = _root()
    if root is not None:
        line = json.dumps([item.request_id, item.stage, item.attempt, time.time()]) + "\n"
        with open(root / f"ran-{os.getpid()}.jsonl", "a") as f:
            f.write(line)


def _hold(ctx: Any, step: int, until: str = "release") -> None:
    """Hold ``ctx``'s item here if this is the first arrival (see the module doc)."""
    item = ctx.item
    _hold_at(
        item.request_id,
        item.stage,
        {"worker_id": ctx.worker_id, "step": step},
        lambda: bool(ctx.cancelled or (until == "yield" and ctx.should_yield)),
    )


def _hold_at(rid: str, point: str, info: dict[str, Any], stop: Any) -> None:
    """The first arrival at ``rid``'s ``point`` writes its reached file (``info`` plus
    pid and time) and waits for the go file, ``stop()`` or ``HOLD_MAX_S``; later
    arrivals pass."""
    root = _root()
    assert root is not None
    try:
        fd = os.open(_file(root, rid, point, "reached"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # held once already (this is the job resumed or re-run)
    with os.fdopen(fd, "w") as f:
        json.dump({**info, "pid": os.getpid(), "t": time.time()}, f)
    go = _file(root, rid, point, "go")
    deadline = time.monotonic() + HOLD_MAX_S
    while time.monotonic() < deadline:
        if go.exists() or stop():
            return
        time.sleep(_POLL_S)


def _gate_serving() -> None:
    """Producer side (``Gate.hold(rid, "serve", k)``): a p2p producer serving one of
    ``rid``'s payloads holds before it writes chunk ``k``; the chunks before it have
    landed and the consumer was told. The transport has no public hook inside a
    transfer, and the fault must land there, so this wraps its per-chunk wait
    (``P2PTransport._await_ready``) in this process; nothing else of it changes (a
    transport closing lets the hold go)."""
    from mooncake_diffusion.transfer.transports.p2p import P2PTransport

    ready = P2PTransport._await_ready

    def await_ready(self: Any, payload_id: str, held: Any, chunk: int) -> bool:
        ok = ready(self, payload_id, held, chunk)
        rid = payload_id.split("/", 1)[0]  # a payload id starts with its request's
        asked = _asked(rid, "serve") if ok else None
        if asked is not None and asked[0] == chunk:
            _hold_at(rid, "serve", {"step": chunk}, self._closing.is_set)
        return ok

    P2PTransport._await_ready = await_ready  # type: ignore[method-assign]


if _root() is not None:
    _gate_serving()


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


def _stepped(fn: Any) -> Any:
    """``fn`` (a denoise) held at the asked step; step 0 holds before it starts."""

    def run(item: Any, ctx: Any) -> Any:
        _ran(item)
        asked = _asked(item.request_id, item.stage)
        if asked is None:
            return fn(item, ctx)
        step, until = asked
        if step == 0:
            _hold(ctx, 0, until)
            return fn(item, ctx)
        return held(fn, step, lambda c, k: _hold(c, k, until))(item, ctx)

    run.__doc__ = f"{fn.__module__}.{fn.__name__}, held where the test asks (module doc)"
    if hasattr(fn, "forget"):  # the stage's Resumable capability stays
        run.forget = fn.forget  # type: ignore[attr-defined]
    return run


def _failing(item: Any, ctx: Any) -> Any:
    def fail(_ctx: Any, k: int) -> None:
        raise RuntimeError(f"injected failure after step {k}")

    return held(stages.denoise, int(os.environ[FAIL_ENV]), fail)(item, ctx)


_failing.forget = stages.forget_denoise  # type: ignore[attr-defined]
denoise = _stepped(stages.denoise)
failing_denoise = _stepped(_failing)
toy_denoise = _stepped(toy.denoise)
load = stages.load  # ``--fn gated``: a stage change loads as the reference pipeline does


def encode(item: Any, ctx: Any) -> Any:
    _ran(item)
    if _asked(item.request_id, item.stage) is not None:
        _hold(ctx, 0)
    return stages.encode(item, ctx)


class _HeldConsumer:
    """The connector, except that the received payload's chunk iterator holds after
    ``k`` chunks (the rest of the transfer happens after the fault)."""

    def __init__(self, connector: Any, ctx: Any, k: int) -> None:
        self._c, self._ctx, self._k = connector, ctx, k

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def consume(self, *a: Any, **kw: Any) -> Any:
        got = self._c.consume(*a, **kw)
        ctx, k = self._ctx, self._k
        inner_iter = got.__iter__

        def chunks() -> Iterator[Any]:
            for i, chunk in enumerate(inner_iter()):
                if i == k:
                    _hold(ctx, k)
                yield chunk

        return _Iter(got, chunks)


class _Iter:
    def __init__(self, got: Any, it: Any) -> None:
        self._got, self._it = got, it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._got, name)

    def __enter__(self) -> _Iter:
        self._got.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._got.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        return self._it()


def decode(item: Any, ctx: Any) -> Any:
    _ran(item)
    asked = _asked(item.request_id, item.stage)
    if asked is not None:
        k = asked[0]
        if k == 0:
            _hold(ctx, 0)
        else:
            ctx.connector = _HeldConsumer(ctx.connector, ctx, k)
    return stages.decode(item, ctx)


# ------------------------------------------------------------------ test side
class Gate:
    """The test's side of the gate, on a directory of its own (e.g. ``tmp_path``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "gate"
        self.root.mkdir(parents=True, exist_ok=True)

    def env(self, step: int = 0, until: str = "release", fail: int = 0) -> dict[str, str]:
        """Worker environment: gated stages read this folder; with ``step`` > 0 every
        request's denoise holds at ``step`` until ``release()`` (``until="release"``)
        or until the item is asked to yield (``"yield"``); ``fail``: the step after
        which ``failing_denoise`` raises."""
        assert until in ("release", "yield"), until
        return {
            DIR_ENV: str(self.root),
            STEP_ENV: str(step),
            UNTIL_ENV: until,
            FAIL_ENV: str(fail),
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }

    def hold(self, rid: str, stage: str, step: int, until: str = "release") -> None:
        """Before ``rid`` is submitted: hold its ``stage`` at ``step`` (module doc)."""
        spec = json.dumps({"step": step, "until": until})
        _file(self.root, rid, stage, "hold").write_text(spec)

    def reached(self, rid: str, stage: str = "denoise", timeout: float = 180.0) -> dict:
        """Block until a worker holds ``rid``'s ``stage``; what it wrote (worker_id,
        step, pid, t)."""
        path = _file(self.root, rid, stage, "reached")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return json.loads(path.read_text())
            except (FileNotFoundError, ValueError):  # not there, or being written
                time.sleep(0.01)
        raise AssertionError(f"{rid} never reached its {stage} gate within {timeout}s")

    def wait_reached(self, rid: str, timeout: float = 180.0) -> str:
        """Block until a worker holds ``rid``'s denoise at the gate; that worker's id."""
        return str(self.reached(rid, "denoise", timeout)["worker_id"])

    def ran(self) -> list[tuple[str, str, int, float]]:
        """Every item a gated stage started, in any worker: (request, stage, attempt,
        wall time)."""
        out = []
        for path in sorted(self.root.glob("ran-*.jsonl")):
            for line in path.read_text().splitlines():
                rid, stage, attempt, t = json.loads(line)
                out.append((rid, stage, int(attempt), float(t)))
        return out

    def release(self, rid: str, stage: str = "denoise") -> None:
        """Let ``rid``'s ``stage`` go on from the gate (no-op if it was never held)."""
        _file(self.root, rid, stage, "go").touch()

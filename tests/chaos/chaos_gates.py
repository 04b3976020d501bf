"""The reference pipeline's stage functions with a gate: hold at a known point.

A test that must land a fault mid-job does not poll and hope. Before it submits
request R it writes ``$MCD_CHAOS_GATES/R.STAGE.hold`` (the JSON ``{"step": k}``;
for decode ``k`` is the number of latent chunks consumed before holding). The
stage's first attempt of R then writes ``R.STAGE.reached`` at that point and
waits until ``R.STAGE.go`` exists; later attempts run straight through.

    mooncake-diffusion worker --stage denoise --fn gated:denoise   (PYTHONPATH has tests/chaos)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mooncake_diffusion.orchestrator.model import WorkItem
from mooncake_diffusion.orchestrator.worker import StageContext
from mooncake_diffusion.payload import StagePayload
from mooncake_diffusion.pipeline import stages

GATES_ENV = "MCD_CHAOS_GATES"


def _gate(item: WorkItem) -> tuple[Path, int] | None:
    root = os.environ.get(GATES_ENV)
    if not root or item.attempt != 1:
        return None
    base = Path(root) / f"{item.request_id}.{item.stage}"
    hold = base.with_suffix(base.suffix + ".hold")
    if not hold.exists():
        return None
    return base, int(json.loads(hold.read_text())["step"])


def _hold(base: Path) -> None:
    base.with_suffix(base.suffix + ".reached").write_text(str(time.time()))
    go = base.with_suffix(base.suffix + ".go")
    while not go.exists():
        time.sleep(0.02)


def encode(item: WorkItem, ctx: StageContext) -> StagePayload:
    gate = _gate(item)
    if gate is not None:
        _hold(gate[0])
    return stages.encode(item, ctx)


def denoise(item: WorkItem, ctx: StageContext) -> StagePayload | None:
    gate = _gate(item)
    if gate is not None:
        base, k = gate
        report = ctx.progress

        def progress(step: int, total: int) -> None:
            report(step, total)
            if step == k:
                _hold(base)

        ctx.progress = progress  # type: ignore[method-assign]
    return stages.denoise(item, ctx)


class _HeldConsumer:
    """The connector, except that the received payload's chunk iterator holds after
    ``k`` chunks (the rest of the transfer happens after the fault)."""

    def __init__(self, connector: Any, base: Path, k: int) -> None:
        self._c, self._base, self._k = connector, base, k

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def consume(self, *a: Any, **kw: Any) -> Any:
        got = self._c.consume(*a, **kw)
        base, k = self._base, self._k
        inner_iter = got.__iter__

        def held() -> Iterator[Any]:
            for i, chunk in enumerate(inner_iter()):
                if i == k:
                    _hold(base)
                yield chunk

        return _Iter(got, held)


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


def decode(item: WorkItem, ctx: StageContext) -> bytes:
    gate = _gate(item)
    if gate is not None:
        base, k = gate
        if k == 0:
            _hold(base)
        else:
            ctx.connector = _HeldConsumer(ctx.connector, base, k)  # type: ignore[assignment]
    return stages.decode(item, ctx)

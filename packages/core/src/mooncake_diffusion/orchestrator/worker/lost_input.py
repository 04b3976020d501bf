"""Telling a lost input apart from a failed stage, for the worker runtime.

A stage can fail for many reasons; only one of them is mended by running the
*previous* stage again: its input payload is gone (the store host died with it,
its peer-to-peer producer did, or the master forgot it). ``InputWatch`` is the
connector a stage function sees (``StageContext.connector``): it forwards every
call to the worker's connector and sets ``lost`` when consuming exactly the
item's input raises one of ``LOST``, whether at the ``consume`` call, while
iterating its chunks, or when its ``with`` block ends. Other consumes (caches,
side inputs) pass through unwatched. The worker then reports the failure with
``input_lost`` and the orchestrator re-runs the upstream stage (``Rerun``).

The input is consumed with ``committed=True``: the orchestrator hands a stage only
outputs their producers acknowledged after the publish completed, so an input that
is not there is gone, and the stage learns it at once instead of at its deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mooncake_diffusion.errors import PayloadGoneError, PeerGoneError

__all__ = ["LOST", "InputWatch"]

#: errors that say the payload itself is gone (not late, not malformed)
LOST = (PayloadGoneError, PeerGoneError)


class InputWatch:
    """``connector`` as one item's stage sees it; ``lost`` once its input is gone."""

    def __init__(self, connector: Any, item_input: bytes) -> None:
        self._connector = connector
        self._input = item_input
        self.lost = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connector, name)

    def consume(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._input or handle != self._input:
            return self._connector.consume(handle, *args, **kwargs)
        kwargs.setdefault("committed", True)
        try:
            got = self._connector.consume(handle, *args, **kwargs)
        except LOST:
            self.lost = True
            raise
        return _Watched(got, self)


class _Watched:
    """A received payload whose chunk iteration and exit mark the watch on ``LOST``."""

    def __init__(self, got: Any, watch: InputWatch) -> None:
        self._got = got
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._got, name)

    def __enter__(self) -> _Watched:
        self._got.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        try:
            return self._got.__exit__(*exc)
        except LOST:
            self._watch.lost = True
            raise

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._got
        except LOST:
            self._watch.lost = True
            raise

"""``Engine.write`` when Mooncake refuses a range after it accepted the ones before it.

Mooncake cannot cancel a submitted transfer, so the ranges accepted before the refusal
still read ``src`` and write ``dst``; the write must not fail (letting its caller free or
unregister that memory) until they ended. Mooncake's ``TransferEngine`` is replaced by
a scripted stand-in because a real one refuses a submit only in states this machine
cannot provoke on demand between two submits of one write (a segment gone bad); the
polling logic under test is ``Engine``'s own.
"""

from __future__ import annotations

import time

import pytest

from mooncake_diffusion._mooncake.engine import Engine, Pacer
from mooncake_diffusion.errors import DeadlineExceededError, TransferError


class _ScriptedTE:
    """Answers each submit with the next scripted batch id (0: refused). A batch in
    ``ends`` answers that status at its first check; any other is pending for
    ``polls`` checks (``None``: for ever), then done (1). Mooncake frees a batch
    once it ended: checking it again fails the test."""

    def __init__(
        self, ids: list[int], polls: int | None, ends: dict[int, int] | None = None
    ) -> None:
        self.ids = ids
        self.polls = polls
        self.ends = ends or {}
        self.checked: dict[int, int] = {}
        self.ended: set[int] = set()

    def transfer_submit_write(self, peer: str, src: int, dst: int, n: int) -> int:
        return self.ids.pop(0)

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.ended, f"batch {batch} checked after it ended"
        n = self.checked[batch] = self.checked.get(batch, 0) + 1
        rc = self.ends.get(batch, 0 if self.polls is None or n <= self.polls else 1)
        if rc:
            self.ended.add(batch)
        return rc


def _engine(te: _ScriptedTE) -> Engine:
    engine = Engine.__new__(Engine)  # no Mooncake: only the members write() uses
    engine._te, engine.pacer = te, Pacer()
    return engine


def test_a_refused_range_fails_the_write_only_after_the_ranges_before_it_ended():
    te = _ScriptedTE([7, 8, 0], polls=3)
    with pytest.raises(TransferError, match="failed"):
        _engine(te).write("peer:1", [1, 2, 3], [4, 5, 6], [Engine.SYNC_BELOW] * 3)
    assert te.checked == {7: 4, 8: 4}  # polled until done, then the error
    assert te.ids == []


@pytest.mark.parametrize("how", ["a range failed", "a range refused"])
def test_with_a_deadline_a_range_still_in_flight_is_a_deadline_error_not_a_failure(how):
    """``DeadlineExceededError`` tells the caller to keep ``src`` and give ``dst`` up
    (a range may still move); ``TransferError`` would let it retry into the same
    ``dst`` or free ``src`` while batch 8, never ending here, still reads it."""
    ids = [7, 8, 0] if how == "a range refused" else [7, 8]
    te = _ScriptedTE(ids, polls=None, ends={7: -1})  # 7 fails at once, 8 never ends
    with pytest.raises(DeadlineExceededError, match="1 of"):
        _engine(te).write(
            "peer:1", [1, 2, 3][: len(ids)], [4, 5, 6][: len(ids)],
            [Engine.SYNC_BELOW] * len(ids), deadline=time.monotonic() + 0.2,
        )  # fmt: skip
    assert te.ended == {7} and te.checked[8] >= 1

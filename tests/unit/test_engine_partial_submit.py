"""``Engine.write`` when Mooncake refuses a range after it accepted the ones before it.

Mooncake cannot cancel a submitted transfer, so the ranges accepted before the refusal
still read ``src`` and write ``dst``; the write must not fail (letting its caller free or
unregister that memory) until they ended. Mooncake's ``TransferEngine`` is replaced by
a scripted stand-in because a real one refuses a submit only in states this machine
cannot provoke on demand between two submits of one write (a segment gone bad); the
polling logic under test is ``Engine``'s own.
"""

from __future__ import annotations

import pytest

from mooncake_diffusion._mooncake.engine import Engine, Pacer
from mooncake_diffusion.errors import TransferError


class _ScriptedTE:
    """Answers each submit with the next scripted batch id (0: refused); a batch is
    pending for ``polls`` checks, then done (1)."""

    def __init__(self, ids: list[int], polls: int) -> None:
        self.ids = ids
        self.polls = polls
        self.checked: dict[int, int] = {}

    def transfer_submit_write(self, peer: str, src: int, dst: int, n: int) -> int:
        return self.ids.pop(0)

    def transfer_check_status(self, batch: int) -> int:
        self.checked[batch] = self.checked.get(batch, 0) + 1
        return 1 if self.checked[batch] > self.polls else 0


def test_a_refused_range_fails_the_write_only_after_the_ranges_before_it_ended():
    engine = Engine.__new__(Engine)  # no Mooncake: only the members write() uses
    te = _ScriptedTE([7, 8, 0], polls=3)
    engine._te, engine.pacer = te, Pacer()
    with pytest.raises(TransferError, match="failed"):
        engine.write("peer:1", [1, 2, 3], [4, 5, 6], [Engine.SYNC_BELOW] * 3)
    assert te.checked == {7: 4, 8: 4}  # polled until done, then the error
    assert te.ids == []

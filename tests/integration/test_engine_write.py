"""core's ``Engine.write`` between two real Transfer Engines over loopback TCP: a large
write with no deadline is submitted and polled rather than handed to Mooncake's
synchronous call (whose busy wait takes a core from Mooncake's own TCP threads), and
it keeps the synchronous call's contract: every byte lands, and a failed range is
reported only once the other ranges have ended."""

from __future__ import annotations

import threading

import pytest
import torch

from mooncake_diffusion._mooncake.engine import Engine
from mooncake_diffusion.errors import TransferError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.testing import assert_no_leaks

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture
def pair():
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    made = [Engine(MooncakeSettings(same_host=False)) for _ in range(2)]
    yield made
    for e in made:
        e.close()
    assert all(e.regs.count == 0 for e in made)
    assert_no_leaks(None, threads)


def _pinned(engine: Engine, t: torch.Tensor) -> torch.Tensor:
    engine.regs.pin(describe("t", t)[1])
    return t


def test_a_large_write_without_a_deadline_is_polled_and_lands(pair) -> None:
    sender, receiver = pair
    n = 2 * MIB
    assert n >= Engine.SYNC_BELOW and n >= sender.pacer.LEARN_BYTES
    src = _pinned(sender, torch.randint(0, 256, (n,), dtype=torch.uint8))
    dst = _pinned(receiver, torch.zeros(n, dtype=torch.uint8))
    sender.write(receiver.segment, [src.data_ptr()], [dst.data_ptr()], [n])
    assert torch.equal(src, dst)
    # only the polled path learns a rate: Mooncake's synchronous call does not report one
    assert sender.pacer.s_per_byte > 0
    small = 4096
    assert small < Engine.SYNC_BELOW
    dst.zero_()
    sender.write(receiver.segment, [src.data_ptr()], [dst.data_ptr()], [small])
    assert torch.equal(src[:small], dst[:small]) and not dst[small:].any()
    for e, t in ((sender, src), (receiver, dst)):
        e.regs.unpin(describe("t", t)[1])


def test_a_failed_range_is_reported_after_the_others_landed(pair) -> None:
    sender, receiver = pair
    n = MIB
    src = _pinned(sender, torch.randint(0, 256, (2 * n,), dtype=torch.uint8))
    dst = _pinned(receiver, torch.zeros(n, dtype=torch.uint8))
    unregistered = torch.zeros(n, dtype=torch.uint8)  # the peer never registered it
    with pytest.raises(TransferError, match="failed"):
        sender.write(
            receiver.segment,
            [src.data_ptr(), src.data_ptr() + n],
            [unregistered.data_ptr(), dst.data_ptr()],
            [n, n],
        )
    # the good range had ended (landed) before the error came back
    assert torch.equal(dst, src[n:])
    assert not unregistered.any()
    for e, t in ((sender, src), (receiver, dst)):
        e.regs.unpin(describe("t", t)[1])

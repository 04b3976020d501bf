"""core's DirectEngine (``mooncake_diffusion.direct``): address-level pushes between
two real Transfer Engines over loopback TCP, and the same-host paths. The SGLang
adapter's tests drive it across processes through sglang's own classes."""

from __future__ import annotations

import threading

import pytest
import torch

from mooncake_diffusion.direct import (
    DirectEngine,
    PeerSession,
    RetryPolicy,
    UnregisteredDestinationError,
    allocate_pool,
    release_pool,
)
from mooncake_diffusion.errors import ConfigError, PeerGoneError, TransferError
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.testing import assert_no_leaks

pytestmark = pytest.mark.integration

N = 1 << 20


@pytest.fixture
def engines():
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    retry = RetryPolicy(attempts=2, backoff_s=0.01)
    made = [
        DirectEngine(MooncakeSettings(), retry=retry),
        DirectEngine(MooncakeSettings(same_host=False), retry=retry),
        DirectEngine(MooncakeSettings(), retry=retry),
    ]
    yield made
    for e in made:
        e.close()
    assert all(e.stats().registered == 0 for e in made)
    assert_no_leaks(None, threads)


def test_every_path_moves_the_bytes(engines) -> None:
    shm_sender, net_sender, receiver = engines
    src = torch.randint(0, 256, (N,), dtype=torch.uint8)
    pool = allocate_pool(N)
    plain = torch.zeros(N, dtype=torch.uint8)  # registered, but not a shared pool
    try:
        for e in (shm_sender, net_sender):
            e.register(src.data_ptr(), N)
        receiver.register(pool.base, N)
        receiver.register(plain.data_ptr(), N)
        session = receiver.session
        peer = PeerSession.parse(session)
        assert peer.segment == receiver.segment and len(peer.regions) == 2
        half = N // 2
        cases = [
            (shm_sender, pool.base, pool.tensor, "shm"),
            (shm_sender, plain.data_ptr(), plain, "vm"),
            (net_sender, pool.base, pool.tensor, "net"),
            (net_sender, plain.data_ptr(), plain, "net"),
        ]
        for sender, base, view, path in cases:
            view.zero_()
            # two ranges, swapped halves: offsets are honoured per range
            srcs = [src.data_ptr(), src.data_ptr() + half]
            got = sender.write(session, srcs, [base + half, base], [half, half])
            assert got == path
            assert torch.equal(view[half:], src[:half]) and torch.equal(view[:half], src[half:])
        # a plain "host:port" session (what sglang's own engine advertises): network
        pool.tensor.zero_()
        assert shm_sender.write(receiver.segment, [src.data_ptr()], [pool.base], [N]) == "net"
        assert torch.equal(pool.tensor, src)
        stats = shm_sender.stats()
        assert stats.by_path == {"shm": 1, "vm": 1, "net": 1} and stats.bytes == 3 * N
        for e in (shm_sender, net_sender):
            e.unregister(src.data_ptr())
        receiver.unregister(pool.base)
        receiver.unregister(plain.data_ptr())
    finally:
        release_pool(pool.base)


def test_errors_name_the_cause(engines) -> None:
    sender, _, receiver = engines
    src = torch.zeros(N, dtype=torch.uint8)
    dst = torch.zeros(N, dtype=torch.uint8)
    sender.register(src.data_ptr(), N)
    receiver.register(dst.data_ptr(), N)
    with pytest.raises(UnregisteredDestinationError, match="outside the memory peer"):
        sender.write(receiver.session, [src.data_ptr()], [dst.data_ptr() + N - 10], [100])
    with pytest.raises(TransferError, match=r"refused .* is the destination registered"):
        sender.write(receiver.segment, [src.data_ptr()], [dst.data_ptr() + N - 10], [100])
    with pytest.raises(PeerGoneError, match=r"127\.0\.0\.1:1 is unreachable"):
        sender.write("127.0.0.1:1", [src.data_ptr()], [dst.data_ptr()], [100])
    with pytest.raises(ConfigError, match="malformed peer session"):
        sender.write("127.0.0.1:5|mcd9|x", [src.data_ptr()], [dst.data_ptr()], [100])
    stats = sender.stats()
    assert stats.failures == 4 and stats.retries == 2 and stats.writes == 0
    sender.unregister(src.data_ptr())
    receiver.unregister(dst.data_ptr())

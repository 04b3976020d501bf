"""core's DirectEngine (``mooncake_diffusion.handoff.direct``): address-level pushes between
two real Transfer Engines over loopback TCP, and the same-host paths. The SGLang
adapter's tests drive it across processes through sglang's own classes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from mooncake_diffusion.errors import (
    ConfigError,
    DeadlineExceededError,
    PeerGoneError,
    TransferError,
)
from mooncake_diffusion.handoff.direct import (
    DirectEngine,
    PeerSession,
    RetryPolicy,
    UnregisteredDestinationError,
    allocate_pool,
    may_write_late,
    release_pool,
)
from mooncake_diffusion.memory.samehost import process_stopped
from mooncake_diffusion.platform.childproc import JsonLinesChild
from mooncake_diffusion.platform.settings import MooncakeSettings
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
    with pytest.raises(UnregisteredDestinationError, match="outside the memory peer") as e1:
        sender.write(receiver.session, [src.data_ptr()], [dst.data_ptr() + N - 10], [100])
    with pytest.raises(TransferError, match=r"refused .* is the destination registered") as e2:
        sender.write(receiver.segment, [src.data_ptr()], [dst.data_ptr() + N - 10], [100])
    with pytest.raises(PeerGoneError, match=r"127\.0\.0\.1:1 is unreachable") as e3:
        sender.write("127.0.0.1:1", [src.data_ptr()], [dst.data_ptr()], [100])
    with pytest.raises(ConfigError, match="malformed peer session") as e4:
        sender.write("127.0.0.1:5|mcd9|x", [src.data_ptr()], [dst.data_ptr()], [100])
    # refused before any byte moved, nobody there, malformed: the receiver may reuse
    # the destination; a network write that failed is no fence (see may_write_late)
    assert [may_write_late(e.value) for e in (e1, e2, e3, e4)] == [False, True, False, False]
    stats = sender.stats()
    assert stats.failures == 4 and stats.retries == 2 and stats.writes == 0
    sender.unregister(src.data_ptr())
    receiver.unregister(dst.data_ptr())


RECEIVER = [sys.executable, os.path.join(os.path.dirname(__file__), "direct_receiver.py")]


def test_one_blocking_write_is_bounded_by_the_timeout() -> None:
    """A peer that stops reading (SIGSTOP) mid-write: the write ends with a typed
    timeout instead of blocking; the engine works again once the peer resumes.

    128 MiB cannot fit in loopback socket buffers, so the write cannot complete
    while the peer is stopped; ``timeout_s`` is configuration, not a measured bound.
    """
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    nbytes = 128 << 20
    settings = MooncakeSettings(same_host=False)
    sender = DirectEngine(settings, retry=RetryPolicy(attempts=3, timeout_s=2.0))
    src = torch.full((nbytes,), 7, dtype=torch.uint8)
    sender.register(src.data_ptr(), nbytes)
    with JsonLinesChild(RECEIVER, settings, "direct receiver") as peer:
        # the last 4 KiB of the landing buffer lie outside the write that times out
        # (Mooncake may still finish that one after the peer resumes)
        got = peer.request(op="setup", nbytes=nbytes + 4096)
        segment, addr = got["segment"], got["addr"]
        # first contact while the peer runs (the handshake is Mooncake's own)
        assert sender.write(segment, [src.data_ptr()], [addr + nbytes], [4096]) == "net"
        assert peer.request(op="byte", at=nbytes)["byte"] == 7
        os.kill(peer.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeadlineExceededError, match="still in flight at the deadline") as e:
                sender.write(segment, [src.data_ptr()], [addr], [nbytes])
            assert may_write_late(e.value)  # the receiver must not reuse [addr, +nbytes)
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        stats = sender.stats()
        assert stats.failures == 1 and stats.retries == 0  # a timeout is not retried
        # the peer resumed: the engine still writes there
        fresh = torch.full((4096,), 9, dtype=torch.uint8)  # src stays untouched
        sender.register(fresh.data_ptr(), 4096)
        assert sender.write(segment, [fresh.data_ptr()], [addr + nbytes], [4096]) == "net"
        sender.unregister(fresh.data_ptr())
        assert peer.request(op="byte", at=nbytes)["byte"] == 9
    sender.unregister(src.data_ptr())
    sender.close()
    assert_no_leaks(None, threads)


def test_a_dead_receiver_of_a_mapped_pool_is_reported() -> None:
    """Same host: the sender keeps the receiver's pool mapped, so a copy into it
    succeeds after the receiver died; the write must still fail as peer gone."""
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    sender = DirectEngine(MooncakeSettings())
    src = torch.full((N,), 5, dtype=torch.uint8)
    sender.register(src.data_ptr(), N)
    peer = JsonLinesChild(RECEIVER, MooncakeSettings(), "direct receiver")
    try:
        got = peer.request(op="setup", nbytes=N, pool=True)
        session, addr = got["session"], got["addr"]
        assert sender.write(session, [src.data_ptr()], [addr], [N]) == "shm"  # mapped now
        assert peer.request(op="byte", at=N - 1)["byte"] == 5
        peer.kill()  # SIGKILL and reap
        with pytest.raises(PeerGoneError, match="is gone"):
            sender.write(session, [src.data_ptr()], [addr], [N])
    finally:
        peer.close()
    assert sender.stats().failures == 1
    sender.unregister(src.data_ptr())
    sender.close()
    assert_no_leaks(None, threads)


@pytest.mark.parametrize("pool", [True, False], ids=["shm", "vm"])
def test_a_stopped_same_host_receiver_is_bounded_by_the_timeout(pool: bool) -> None:
    """Same host, the receiver SIGSTOPped: the copy into its memory succeeds, but it
    reads nothing, so the write ends with a typed timeout within ``timeout_s`` (as the
    network path does) instead of reporting a push nobody will read. Once the receiver
    runs again, writes succeed as before."""
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    sender = DirectEngine(MooncakeSettings(), retry=RetryPolicy(attempts=2, timeout_s=1.0))
    src = torch.full((N,), 3, dtype=torch.uint8)
    sender.register(src.data_ptr(), N)
    with JsonLinesChild(RECEIVER, MooncakeSettings(), "direct receiver") as peer:
        got = peer.request(op="setup", nbytes=N, pool=pool)
        session, addr = got["session"], got["addr"]
        path = "shm" if pool else "vm"
        assert sender.write(session, [src.data_ptr()], [addr], [N]) == path
        os.kill(peer.proc.pid, signal.SIGSTOP)
        try:
            hang_guard = time.monotonic() + 60
            while not process_stopped(peer.proc.pid):  # the stop is delivered asynchronously
                assert time.monotonic() < hang_guard, "the receiver never stopped"
                time.sleep(0.005)
            with pytest.raises(DeadlineExceededError, match="is stopped") as e:
                sender.write(session, [src.data_ptr()], [addr], [N])
            assert not may_write_late(e.value)  # the copy was made in this thread
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        assert sender.write(session, [src.data_ptr()], [addr], [N]) == path
        assert peer.request(op="byte", at=N - 1)["byte"] == 3
    assert sender.stats().failures == 1
    sender.unregister(src.data_ptr())
    sender.close()
    assert_no_leaks(None, threads)

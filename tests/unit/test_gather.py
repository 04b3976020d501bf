"""The store transport's scratch buffers: registered once, reused, bounded while idle,
and all unregistered by close(). Pure logic over a recording stand-in for the store
client's register/unregister calls."""

import threading

import pytest

from helpers import Recorder
from mooncake_diffusion.registration import Registrations
from mooncake_diffusion.transports.gather import MIN_BYTES, ScratchPool

pytestmark = pytest.mark.unit


def make(idle_bytes=64 << 20):
    rec = Recorder()
    regs = Registrations(rec.register, rec.unregister)
    return rec, regs, ScratchPool(regs, idle_bytes)


def test_a_buffer_is_registered_once_and_reused_after_it_is_given_back():
    rec, regs, pool = make()
    a = pool.take(1_209_600)
    assert a.nbytes >= 1_209_600 and rec.live == {a.ptr: a.nbytes}
    pool.give(a)
    b = pool.take(1_100_000)  # same size class (2 MiB): the very buffer, no new registration
    assert b is a and rec.calls == 1
    c = pool.take(1_100_000)  # taken while b is out: a second buffer
    assert c.ptr != b.ptr and rec.calls == 2 and regs.temporary == 0
    pool.give(b)
    pool.give(c)
    pool.close()
    assert rec.live == {} and regs.count == 0


def test_sizes_round_up_to_a_power_of_two_from_the_minimum():
    rec, _, pool = make()
    small, odd = pool.take(1), pool.take(MIN_BYTES * 3)
    assert small.nbytes == MIN_BYTES and odd.nbytes == MIN_BYTES * 4
    pool.give(small)
    pool.give(odd)
    pool.close()
    assert rec.live == {}


def test_idle_buffers_beyond_the_budget_are_unregistered_at_once():
    rec, regs, pool = make(idle_bytes=MIN_BYTES * 2)
    bufs = [pool.take(MIN_BYTES) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_nbytes == MIN_BYTES * 2 and len(rec.live) == 2
    pool.close()
    assert rec.live == {} and regs.count == 0


def test_a_buffer_given_back_after_close_is_unregistered():
    rec, regs, pool = make()
    out = pool.take(10)
    pool.close()
    assert rec.live == {out.ptr: out.nbytes}  # still the taker's
    pool.give(out)
    assert rec.live == {} and regs.count == 0


def test_concurrent_takers_never_share_a_buffer():
    rec, _, pool = make()
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[str] = []

    def work():
        for _ in range(50):
            s = pool.take(4096)
            with lock:
                if s.ptr in seen:
                    errors.append(f"{s.ptr:#x} handed out twice")
                seen.append(s.ptr)
            with lock:
                seen.remove(s.ptr)
            pool.give(s)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.close()
    assert rec.live == {} and all(not t.is_alive() for t in threads)

"""RecycledBuffers: reuse only after every view is gone, a bounded idle set, and
nothing left registered after close. Registration is a recording fake (pure logic)."""

import gc
import threading

import numpy as np
import pytest
import torch

from mooncake_diffusion.memory.recycle import RecycledBuffers

pytestmark = pytest.mark.unit

MIB = 1 << 20


class Recorder:
    def __init__(self):
        self.live: dict[int, int] = {}
        self.calls = 0

    def register(self, arr):
        self.calls += 1
        self.live[arr.ctypes.data] = arr.nbytes

    def unregister(self, arr):
        del self.live[arr.ctypes.data]


def make(idle_bytes=64 * MIB):
    rec = Recorder()
    return rec, RecycledBuffers(rec.register, rec.unregister, idle_bytes=idle_bytes)


def test_a_dropped_buffer_is_reused_without_registering_again():
    rec, bufs = make()
    a = bufs.take(3 * MIB)
    assert a.nbytes == 3 * MIB and a.dtype == np.uint8
    ptr = a.ctypes.data
    del a
    gc.collect()
    b = bufs.take(3 * MIB)
    assert b.ctypes.data == ptr and bufs.allocations == 1 and rec.calls == 1
    del b
    bufs.close()
    assert rec.live == {}


def test_a_buffer_freed_on_a_thread_inside_the_pool_lock_does_not_deadlock():
    """The cyclic collector runs a finaliser on whichever thread allocates, which can
    be one holding the pool's lock (inside ``take``). Here the last reference dies
    while the lock is held; a finaliser that took the lock would hang this thread."""
    rec, bufs = make()
    box = [bufs.take(MIB)]
    done = threading.Event()

    def drop():
        with bufs._lock:  # what a collection inside take()'s locked section does
            box.clear()  # the array dies here: its finaliser runs now, on this thread
        done.set()

    threading.Thread(target=drop, daemon=True).start()
    assert done.wait(30), "the finaliser blocked on the pool's own lock"
    assert bufs.busy == 0 and bufs.idle_count == 1  # it came back, and is reused
    again = bufs.take(MIB)
    assert bufs.allocations == 1
    del again
    bufs.close()
    assert rec.live == {}


def test_a_buffer_is_not_reused_while_any_view_of_it_lives():
    rec, bufs = make()
    a = bufs.take(2 * MIB)
    a[:] = 7
    t = torch.from_numpy(a).view(torch.int16)[10:20]  # a torch view of a slice
    v = a[5:9].view(np.int32)  # and a numpy view
    ptr = a.ctypes.data
    del a
    gc.collect()
    b = bufs.take(2 * MIB)
    assert b.ctypes.data != ptr and bufs.busy == 2
    b[:] = 1
    assert int(t[0]) == 0x0707 and int(v[0]) == 0x07070707  # untouched by the second take
    del t, v, b
    gc.collect()
    assert bufs.busy == 0
    c = bufs.take(2 * MIB)
    assert bufs.allocations == 2 and bufs.busy == 1  # one of the two: no third buffer
    del c
    bufs.close()
    assert rec.live == {}


def test_idle_buffers_beyond_the_budget_are_unregistered():
    rec, bufs = make(idle_bytes=4 * MIB)
    held = [bufs.take(4 * MIB) for _ in range(3)]
    assert len(rec.live) == 3
    del held
    gc.collect()
    assert bufs.idle == 12 * MIB  # returned; trimmed on the next take, not in a finaliser
    x = bufs.take(1 * MIB)  # reuses one, frees the rest above the budget
    assert bufs.idle <= 4 * MIB and len(rec.live) <= 2
    del x
    bufs.close()
    assert rec.live == {}


def test_arrays_held_at_close_stay_valid_and_are_never_reused():
    rec, bufs = make()
    a = bufs.take(2 * MIB)
    a[:] = 3
    bufs.close()
    assert rec.live == {} and int(a[-1]) == 3
    with pytest.raises(RuntimeError, match="closed"):
        bufs.take(1)
    del a
    gc.collect()
    assert bufs.idle == 0


def test_concurrent_takers_never_share_a_buffer():
    """The store transport's gather scratch takes from one pool on many threads."""
    import threading

    rec, bufs = make()
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[str] = []

    def work():
        for _ in range(50):
            a = bufs.take(4096)
            with lock:
                if a.ctypes.data in seen:
                    errors.append(f"{a.ctypes.data:#x} handed out twice")
                seen.append(a.ctypes.data)
            with lock:
                seen.remove(a.ctypes.data)
            del a  # back to the pool

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert 1 <= bufs.idle_count <= 4 and bufs.busy == 0  # at most one per thread
    bufs.close()
    assert rec.live == {} and all(not t.is_alive() for t in threads)

"""``ReceivedPayload.release``: memory handed back once, and only after the transfer ended."""

from __future__ import annotations

import sys
import threading
import types

from mooncake_diffusion import ReceivedPayload


def _received(calls: list[int]) -> ReceivedPayload:
    handle = types.SimpleNamespace(num_chunks=1)  # all the payload reads of its handle here
    return ReceivedPayload(handle, {}, lambda: calls.append(1), lambda i: {}, deadline=0.0)


def test_release_waits_for_the_transfer_then_hands_memory_back_once_whoever_calls():
    baseline = set(threading.enumerate())
    calls: list[int] = []
    got = _received(calls)
    start = threading.Barrier(9)

    def release() -> None:
        start.wait()
        got.release()

    threads = [threading.Thread(target=release) for _ in range(8)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter allows
    try:
        for t in threads:
            t.start()
        start.wait()
        for t in threads:
            t.join(0.2)
        assert calls == [], "memory handed back while bytes may still land in it"
        got._finish(None)  # the transfer ended
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(old)
    assert calls == [1]
    got.release()  # and once more, after: nothing
    assert calls == [1]
    assert not any(t.is_alive() for t in threads)
    assert set(threading.enumerate()) == baseline

"""The service's stall clock and watch (``clock.StallClock``, ``stalls.StallWatch``):
time less the stalls reported, never going back; a turn counts as a stall only past
the threshold, and a freeze of the process is noticed. Pure logic, plus the watch's
real thread (a freeze is stood in for by a clock that jumps)."""

from __future__ import annotations

import time

import pytest

from mooncake_diffusion.orchestrator.clock import StallClock
from mooncake_diffusion.orchestrator.stalls import StallWatch
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.unit


def test_stall_clock_takes_stalls_out_and_never_goes_back():
    clock = StallClock()
    a = clock.now()
    clock.stalled(1000.0)  # far more than has passed since ``a``: time holds level
    b = clock.now()
    assert b == a
    clock.stalled(-5.0)  # ignored
    assert clock.taken == 1000.0
    time.sleep(0.01)
    c = clock.now()
    assert c == b  # still 1,000 s behind the monotonic clock, so held level
    fresh = StallClock()
    m0 = time.monotonic()
    t0 = fresh.now()
    fresh.stalled(0.5)
    time.sleep(0.6)
    t1 = fresh.now()
    m1 = time.monotonic()
    assert 0.0 <= t1 - t0 <= (m1 - m0) - 0.5 + 1e-6  # the 0.5 s is not counted


def test_a_turn_counts_as_a_stall_only_past_the_threshold():
    watch = StallWatch(stall_s=0.25)  # not started: only ``take`` is exercised
    assert watch.take(0.2) == 0.0
    assert watch.take(0.3) == 0.3


def test_the_watch_notices_a_late_wake_of_its_thread():
    """A clock that jumps 5 s stands for a thread that was not run for 5 s."""
    baseline = thread_names()
    jump = [0.0]
    watch = StallWatch(period_s=0.01, clock=lambda: time.monotonic() + jump[0]).start()
    try:
        time.sleep(0.05)
        watch.take(0.0)  # whatever lateness the machine gave it so far
        jump[0] = 5.0
        deadline = time.monotonic() + 30
        while watch.take(0.0) < 4.9:
            assert time.monotonic() < deadline, "the late wake was not noticed"
            time.sleep(0.01)
        assert watch.take(0.0) < 4.9  # the jump is reported once
        assert watch.take(1.0) >= 1.0  # a long turn counts (the larger of the two)
    finally:
        watch.close()
    assert_no_leaks(None, baseline)

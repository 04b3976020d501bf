"""The service's stall clock and watch (``clock.StallClock``, ``stalls.StallWatch``):
time less the stalls reported, never going back; a freeze of the process is out of
the first reading of time after it; a turn counts as a stall only past the
threshold, less the freezes in it. Pure logic, plus the watch's real thread (a
freeze is stood in for by a clock that jumps)."""

from __future__ import annotations

import time

import pytest

from mooncake_diffusion.orchestrator.core.clock import StallClock
from mooncake_diffusion.orchestrator.errors import ClockError
from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig
from mooncake_diffusion.orchestrator.service.stalls import StallWatch
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


def test_an_attached_watch_s_freeze_is_out_of_the_very_next_reading():
    """A process stopped in the middle of a turn: the next reading of time, before
    any other call, already leaves the stop out. A source that jumps 30 s stands
    for the stop (the watch and the clock read the same one); the watch is not
    started, so only the reading itself can have noticed."""
    jump = [0.0]

    def source() -> float:
        return time.monotonic() + jump[0]

    clock = StallClock(source)
    watch = StallWatch(clock=source)
    clock.attach(watch)
    before = clock.now()
    jump[0] = 30.0
    after = clock.now()
    assert after - before < 1.0  # without the watch it would be 30 s on
    assert watch.frozen() >= 29.0
    clock.detach()  # what the watch counted stays out
    assert clock.now() - before < 1.0
    bare = StallClock(source)  # the same jump, nothing watching: it is not taken out
    t0 = bare.now()
    jump[0] = 60.0
    assert bare.now() - t0 >= 29.0


def test_one_watch_at_a_time():
    clock = StallClock()
    clock.attach(StallWatch())
    with pytest.raises(ClockError):
        clock.attach(StallWatch())


def test_a_long_turn_less_its_freezes_is_a_stall_only_past_the_threshold():
    """The driver's accounting after a turn (``OrchestratorService._count_stalls``),
    on a service that is not started: a turn of 0.2 s is not a stall, one of 0.3 s
    is; a turn of 5.1 s in which the process froze for 5 s (the watch counts 4.9 s:
    the lateness past its 0.1 s period) ran 0.2 s, not a stall, and the freeze is
    counted once."""
    jump = [0.0]

    def source() -> float:
        return time.monotonic() + jump[0]

    clock = StallClock(source)
    svc = OrchestratorService(ServiceConfig(worker_bind="tcp://127.0.0.1:0"), clock=clock)
    watch = StallWatch(clock=source)  # not started: only readings look
    clock.attach(watch)
    svc._count_stalls(watch, 0.2, watch.frozen())
    assert clock.taken == 0.0 and svc._counters["driver_stall_ms"] == 0
    svc._count_stalls(watch, 0.3, watch.frozen())
    assert clock.taken == 0.3 and svc._counters["driver_stall_ms"] == 300
    before = watch.frozen()
    jump[0] = 5.0
    svc._count_stalls(watch, 5.1, before)
    assert clock.taken == 0.3  # the freeze is the watch's, read by the clock
    assert 4900 <= svc._counters["driver_stall_ms"] - 300 <= 4900 + 100
    assert abs(svc._counters["driver_stall_ms"] - 300 - round(watch.frozen() * 1000)) <= 1


def test_the_watch_notices_a_late_wake_of_its_thread():
    """A clock that jumps 5 s stands for a thread that was not run for 5 s."""
    baseline = thread_names()
    jump = [0.0]
    watch = StallWatch(period_s=0.01, clock=lambda: time.monotonic() + jump[0]).start()
    try:
        time.sleep(0.05)
        start = watch.frozen()  # whatever lateness the machine gave it so far
        jump[0] = 5.0
        deadline = time.monotonic() + 30
        while watch.frozen() - start < 4.9:
            assert time.monotonic() < deadline, "the late wake was not noticed"
            time.sleep(0.01)
        counted = watch.frozen()
        assert counted - start < 5.0 + 1.0  # the jump is counted once
    finally:
        watch.close()
    assert_no_leaks(None, baseline)

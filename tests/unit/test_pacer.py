"""The polled write's pacing: from no guess to one wake-up near the predicted end,
and a rate that follows faster writes at once and slower ones slowly. Pure logic."""

from itertools import islice

import pytest

from mooncake_diffusion._mooncake.engine import _POLL_MAX_S, _POLL_MIN_S, Pacer

pytestmark = pytest.mark.unit

MIB = 1 << 20


def test_without_a_rate_the_pauses_double_from_the_minimum_to_the_cap():
    pauses = list(islice(Pacer().pauses(16 * MIB), 12))
    assert pauses[0] == _POLL_MIN_S and pauses[1] == 2 * _POLL_MIN_S
    assert max(pauses) == _POLL_MAX_S and pauses[-1] == _POLL_MAX_S


def test_a_known_rate_gives_one_long_first_pause_then_short_ones():
    pacer = Pacer()
    pacer.learn(16 * MIB, 0.016)  # 1 ms per MiB
    expect = pacer.predict(32 * MIB)
    assert expect == pytest.approx(0.032)
    pauses = list(islice(pacer.pauses(32 * MIB), 20))
    assert pauses[0] == pytest.approx(Pacer.SHARE * expect)
    assert pauses[1] == _POLL_MIN_S
    assert max(pauses[1:]) <= max(_POLL_MIN_S, expect / 16)


def test_small_writes_neither_teach_nor_use_the_rate():
    pacer = Pacer()
    pacer.learn(4096, 0.01)  # mostly fixed cost: would predict far too long
    assert pacer.s_per_byte == 0.0
    pacer.learn(8 * MIB, 0.008)
    assert pacer.predict(4096) == 0.0
    assert next(pacer.pauses(4096)) == _POLL_MIN_S


def test_the_rate_follows_a_faster_write_at_once_and_a_slower_one_partly():
    pacer = Pacer()
    pacer.learn(MIB, 0.010)
    pacer.learn(MIB, 0.002)  # faster: taken as is
    assert pacer.predict(MIB) == pytest.approx(0.002)
    pacer.learn(MIB, 0.102)  # one stalled write moves the guess a fifth of the way
    assert pacer.predict(MIB) == pytest.approx(0.002 + Pacer.SLOWER_WEIGHT * 0.1)

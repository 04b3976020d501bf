"""Faults landed on the reference pipeline deployed across network-namespace hosts.

Each scenario holds work at the point where its fault must land (``gated``), lands
it, and accounts for every request it accepted: none lost, none completed twice,
every completed output bitwise equal to the colocated run, detection within twice
the heartbeat timeout, and no store key left over afterwards (fds and threads are
measured, see ``_check``)."""

from __future__ import annotations

import pytest
from deploy import HEARTBEAT_S
from scenarios import SCENARIOS, Outcome

pytestmark = pytest.mark.chaos

#: scenarios whose every request must complete (the fault is absorbed)
MUST_COMPLETE = {
    "denoise_partition",
    "decode_stopped",
    "link_flap",
    "orchestrator_restart",
    "store_kill",
    "master_kill",
}

#: scenarios where a request's embeddings are lost with the store: its encode re-runs
MUST_RERUN = {"store_kill", "master_kill"}


#: fds and threads left over are measured and reported (bench/chaos.py), not asserted
#: here: a worker paused or cut off past Mooncake's client TTL reconnects and its
#: Transfer Engine keeps the old TCP sockets (a few per pause, in it and in the store
#: host), native code this project does not own; see docs/chaos.md. Store keys, which
#: are ours, must be zero after every scenario; the service soak asserts fds and threads.
def _check(o: Outcome, name: str) -> None:
    assert o.lost == 0, o
    assert o.duplicates == 0, o
    assert o.completed + o.failed == o.accepted, o
    assert o.failed == 0 or o.reasons, o  # a failure always says why
    if name in MUST_COMPLETE:
        assert o.completed == o.accepted, o
    if name in MUST_RERUN:
        assert o.reruns >= 1, o
    if o.detect_s is not None:
        assert o.detect_s <= 2 * HEARTBEAT_S, o
    assert o.leaked_keys == 0, o


@pytest.mark.parametrize("fn", SCENARIOS, ids=[f.__name__[9:] for f in SCENARIOS])
def test_scenario(deployment, fn):
    o = fn(deployment)
    _check(o, fn.__name__[9:])

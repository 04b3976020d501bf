"""Faults landed on the reference pipeline deployed across network-namespace hosts.

Each scenario holds work at the point where its fault must land (``gated``), lands
it, and accounts for every request it accepted: none lost, none completed twice,
every completed output bitwise equal to the colocated run, detection within twice
the heartbeat timeout, and nothing left over afterwards: no store key, and every
one of our processes (workers, orchestrator, store host) back at its fds and
threads baseline (see ``_check``)."""

from __future__ import annotations

import pytest
from deploy import HEARTBEAT_S
from scenarios import SCENARIOS, Outcome, settle

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

#: scenarios where a request's input is lost: with the store (its encode re-runs) or
#: with its p2p producer (its denoise re-runs)
MUST_RERUN = {"store_kill", "master_kill", "p2p_partition"}

#: Not yet at baseline, measured and reported instead (docs/chaos.md, "What is left
#: over"): after a p2p producer is cut off mid-transfer and healed, the producer and the
#: consumer hold 4-5 more ESTABLISHED connections to each other (none in CLOSE-WAIT,
#: which is asserted) and the producer one more thread. Not fixed: it would need the
#: p2p Transfer Engine recycled, which is not built.
FDS_REPORTED_ONLY = {"p2p_partition"}


#: Leftovers: store keys, and the fds (other than extra ESTABLISHED Transfer Engine
#: connections to live peers: pool members, reported) and threads of our processes
#: against baselines taken after the same warm-up (``scenarios.warm_up``; restarted
#: processes get their own, a restarted store host is compared after a warm-up
#: against it). The
#: mooncake_master binary's fds and threads are reported (``leaked_*_mooncake_master``),
#: not asserted: it is not ours, and after master_kill it is a new process compared
#: with its predecessor (docs/chaos.md). So are the threads and fds of any of our
#: processes the fault replaced (``replaced_threads``, ``replaced_fds``); no host may
#: keep a socket in CLOSE-WAIT.
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
    if name in FDS_REPORTED_ONLY:
        assert all(cw == 0 for *_, cw in o.left_by_host.values()), o.sockets_by_host
    else:
        assert o.leaked_fds == 0 and o.leaked_threads == 0, (o.left_by_host, o.fds_by_host)
        assert all(cw == 0 for *_, cw in o.left_by_host.values()), o.sockets_by_host


@pytest.mark.parametrize("fn", SCENARIOS, ids=[f.__name__[9:] for f in SCENARIOS])
def test_scenario(deployment, fn):
    try:
        o = fn(deployment)
    except BaseException:
        # one failure reports one failure: what this scenario held or left running is
        # let go and finished before the next scenario takes its baselines
        deployment.release_all()
        settle(deployment, list(deployment.requests), timeout=120.0)
        raise
    _check(o, fn.__name__[9:])

"""The chaos tier's deployment: namespaced hosts and the reference pipeline across
them, started once for the module and torn down (namespaces too) even on failure.

Where namespaces cannot be made (not root, no iproute2) every chaos test is
skipped with the reason: reported as not run, never as passed."""

from __future__ import annotations

import pytest
from deploy import HEARTBEAT_S, HOSTS, Deployment
from hosts import Hosts, available
from scenarios import running


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    why = available()
    if why is not None:
        pytest.skip(f"chaos tier not run: {why}")
    work = tmp_path_factory.mktemp("chaos")
    net = Hosts(HOSTS, str(work))
    with running(net, Deployment(net, work, heartbeat_timeout=HEARTBEAT_S)) as d:
        yield d

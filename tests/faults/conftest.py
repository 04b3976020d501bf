"""The ``stack`` fixture: an orchestrator and worker processes over the session's real
Mooncake cluster (``servicestack.ServiceStack``), leak-checked at the end."""

from __future__ import annotations

import threading
import time

import pytest
from servicestack import ServiceStack

from mooncake_diffusion.testing import assert_no_leaks


@pytest.fixture
def stack(tmp_path, mooncake_cluster):
    """At teardown: waits for the release of finished requests' payloads (it follows
    their completion closely; keys under ``stack.lasting`` are not waited for), stops
    every process (those named in ``clean_exit`` must exit 0), runs the test's
    ``after_close`` callbacks (e.g. clearing a cache that is meant to outlive requests),
    then checks no store key and no thread is left."""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    s = ServiceStack(tmp_path, mooncake_cluster.settings.as_env(), heartbeat_timeout=5.0)
    yield s
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = mooncake_cluster.keys()
        if all(k.startswith(s.lasting) for k in left):
            break
        time.sleep(0.1)
    rcs = s.close()
    assert all(rc == 0 for name, rc in rcs.items() if name in s.clean_exit), rcs
    for fn in s.after_close:
        fn(mooncake_cluster)
    assert_no_leaks(mooncake_cluster, baseline)

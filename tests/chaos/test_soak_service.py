"""The service soak, small: requests with random cancels and worker kills; nothing lost,
nothing doubled, every resource back at its baseline (``soak.soak``)."""

from __future__ import annotations

import pytest
from soak import soak

# 49 s idle, several times that beside stress-ng (near the default 300 s hang guard);
# 900 s is the guard `./dev test --under-load` uses. The 1,000 requests are the bench's.
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def test_soak_through_the_service(mooncake_cluster, tmp_path):
    a = soak(mooncake_cluster, tmp_path, 80, seed=7, kills=2)
    assert a["accepted"] == 80, a
    assert a.get("lost", 0) == 0 and a.get("duplicates", 0) == 0, a
    assert a.get("wrong_outputs", 0) == 0 and a.get("failed_without_reason", 0) == 0, a
    assert a["worker_kills"] == 2 and a.get("cancelled", 0) > 0 and a["completed"] > 40, a
    assert a["leaked_keys"] == 0 and a["leaked_fds"] == 0 and a["leaked_threads"] == 0, a
    assert a["leaked_processes"] == 0, a

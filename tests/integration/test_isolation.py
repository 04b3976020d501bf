"""One failure reports one failure: the pytest plugin's shared cluster is cleaned
after a test that leaks store keys, and restarted when it died.

Runs an inner pytest session (its own real cluster) with the plugin loaded the
way the suite loads it, and checks each inner test's outcome."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
pytest_plugins = ["pytester"]

INNER = """
import torch

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.memory.tensors import describe


def test_a_leaks_a_key(mooncake_cluster):
    client = StoreClient(mooncake_cluster.settings)
    buf = torch.ones(64, dtype=torch.uint8)
    region = describe("buf", buf)[1]
    client.regs.pin(region)
    client.put_many(["mcd/leak/0.0"], [[buf.data_ptr()]], [[64]], pin="hard")
    client.regs.unpin(region)
    client.close()  # the object stays in the store host: a leak


def test_b_starts_from_an_empty_store(mooncake_cluster):
    assert mooncake_cluster.keys() == []


def test_c_the_store_host_dies(mooncake_cluster):
    mooncake_cluster.kill_store_host()
    assert not mooncake_cluster.healthy()


def test_d_gets_a_running_cluster_again(mooncake_cluster):
    assert mooncake_cluster.healthy()
    assert mooncake_cluster.keys() == []
"""


def test_a_leak_fails_only_its_own_test_and_a_dead_cluster_is_restarted(pytester):
    pytester.makepyfile(test_inner=INNER)
    # the plugin loaded as the suite loads it (pyproject's addopts)
    result = pytester.runpytest_subprocess(
        "-p", "mooncake_diffusion.testing", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a_leaks_a_key*"])
    result.stdout.fnmatch_lines(["*store keys left behind by this test (now removed)*mcd/leak*"])

"""Fixtures of the vLLM-Omni engine tests (run by ``./dev engines vllm_omni``).

vllm_omni      session: vLLM's general plugins loaded (this adapter's entry
               point ran); returns vLLM-Omni's ``OmniConnectorFactory``
peer           session: the other process (``vo_peer.py``), imported and ready
extra          the deploy-YAML ``extra`` for the session's Mooncake cluster
make           builds connectors in this process through the factory; at
               teardown closes them, closes the peer's, and fails on any
               store key left behind
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import vo_cpu_env  # noqa: F401  (before anything imports vllm)

from mooncake_diffusion.platform.childproc import JsonLinesChild
from mooncake_diffusion.testing import assert_no_leaks

HERE = Path(__file__).resolve().parent
NAME = "MooncakeDiffusionConnector"


@pytest.fixture(scope="session")
def peer(mooncake_cluster) -> Iterator[JsonLinesChild]:
    child = JsonLinesChild(
        [sys.executable, str(HERE / "vo_peer.py")], mooncake_cluster.settings, "vLLM-Omni peer"
    )
    try:
        yield child
    finally:
        child.close()


@pytest.fixture(scope="session", autouse=True)
def vllm_omni(peer) -> Any:
    """Import vLLM-Omni and load vLLM's plugins here while the peer does the same
    (both ~40 s on this machine); session-wide, so no test sees these threads start."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    assert peer.request(op="ready")["ok"]
    return OmniConnectorFactory


@pytest.fixture
def extra(mooncake_cluster) -> dict[str, Any]:
    s = mooncake_cluster.settings
    return {"master": s.master, "admin": s.admin_address, "host": s.local_hostname}


@pytest.fixture
def make(mooncake_cluster, vllm_omni, peer) -> Iterator[Callable[..., Any]]:
    import threading

    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    made: list[Any] = []

    def build(extra: dict[str, Any], name: str = NAME) -> Any:
        conn = vllm_omni.create_connector(ConnectorSpec(name=name, extra=dict(extra)))
        made.append(conn)
        return conn

    yield build
    for conn in made:
        conn.close()
    assert peer.request(op="close")["ok"]
    assert_no_leaks(mooncake_cluster, baseline)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test of this folder also sets up the session: importing vLLM and
    vLLM-Omni here and in the peer (about a minute on an idle 2-core machine, several
    under load). Its hang guard covers that too; every other test keeps the default."""
    mine = [item for item in items if Path(str(item.fspath)).parent == HERE]
    if mine:
        mine[0].add_marker(pytest.mark.timeout(1800))

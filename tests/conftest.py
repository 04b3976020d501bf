"""Shared fixtures. The Mooncake cluster and leak checks come from the
``mooncake_diffusion.testing`` pytest plugin (fixtures ``mooncake_cluster``,
``connector_factory``)."""

from __future__ import annotations

import os
import threading

import pytest

from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.transports.memory import fabric_keys

# Engine adapter tests (tests/engines/NAME) need that engine's own environment;
# `./dev engines NAME` runs them with MCD_ENGINE=NAME. Elsewhere they are not
# collected at all (not skipped: they are run, in their place).
_ENGINE = os.environ.get("MCD_ENGINE", "")
_OTHERS = [d for d in ("vllm_omni", "sglang", "lightx2v", "dynamo") if d != _ENGINE]
collect_ignore_glob = [f"engines/{d}" for d in _OTHERS] if _ENGINE else ["engines/*"]

MODES = [
    pytest.param("memory", marks=pytest.mark.unit, id="memory"),
    pytest.param("p2p", marks=pytest.mark.integration, id="p2p"),
    pytest.param("store", marks=pytest.mark.integration, id="store"),
]


@pytest.fixture(autouse=True)
def _no_thread_left_behind():
    """Every test ends with a leak check: no thread outlives it. (Set up first, so
    it runs after every other fixture's teardown, including connector leak checks.)"""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    yield
    assert_no_leaks(None, baseline)


@pytest.fixture(params=MODES)
def pair(request):
    """(producer, consumer) connectors of one mode, leak-checked at teardown."""
    mode = request.param
    if mode != "memory":
        make = request.getfixturevalue("connector_factory")
        yield make(mode, "denoise"), make(mode, "decode")
        return
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    settings = MooncakeSettings()
    held = set(fabric_keys())  # an earlier test's leak is its own failure, not this one's
    prod = DiffusionConnector("denoise", "memory", settings)
    cons = DiffusionConnector("decode", "memory", settings)
    yield prod, cons
    stats = [prod.stats(), cons.stats()]
    prod.close()
    cons.close()
    assert all(s.temporary_registrations == 0 and s.pool_bytes_in_use == 0 for s in stats), stats
    assert set(fabric_keys()) <= held, sorted(set(fabric_keys()) - held)
    assert_no_leaks(None, baseline)

"""The Mooncake wheel of this engine environment matches its torch (tests/wheelcheck.py),
and ``pool: auto`` reads what the installed build links, not its distribution name."""

import os
import sys

import pytest
from wheelcheck import *  # noqa: F403


def test_pool_auto_sees_a_cuda_build_by_its_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_diffusion_sglang.engine import _cuda_mooncake

    assert _cuda_mooncake() is False  # the CPU wheel these CPU tests import
    deploy = os.environ.get("MCD_MOONCAKE_DEPLOY")
    assert deploy, "run through `./dev engines sglang` (it installs the deployment wheel)"
    monkeypatch.delitem(sys.modules, "mooncake", raising=False)
    monkeypatch.syspath_prepend(deploy)  # its CUDA 13 build first: found, never imported
    assert _cuda_mooncake() is True

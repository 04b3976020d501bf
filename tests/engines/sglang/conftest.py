"""Fixtures of the SGLang adapter's tests (run by `./dev engines sglang`, in
`.venvs/sglang` with the real sglang[diffusion]==0.5.23).

sglang's import takes tens of seconds here, so the tests share one sglang
runtime in this process (plugins activated once, as sglang does per process)
and start one sender process per cross-process test.
"""

from __future__ import annotations

import os

import pytest

# No model hub is reachable here: sglang must not try one. sglang's own Mooncake
# engine defaults to RDMA; these machines have no RDMA NIC.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MC_FORCE_TCP", "1")


@pytest.fixture(scope="session")
def sgl_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local model folder sglang's resolver accepts; sglang's plugins activated."""
    from role_process import activate_plugins, model_dir

    activate_plugins()
    return model_dir(str(tmp_path_factory.mktemp("models")))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter exports its options into the environment; undo that per test."""
    from mooncake_diffusion_sglang.options import ENV

    monkeypatch.delenv(ENV, raising=False)

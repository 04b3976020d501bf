"""sglang's transfer-engine factory, after sglang applied the adapter's hooks."""

from __future__ import annotations

import pytest
from mooncake_diffusion_sglang.options import BACKEND
from role_process import serve_args

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("clean_env")]


def _factory():
    # the binding sglang's scheduler calls (`from ...engine import create_transfer_engine`)
    from sglang.multimodal_gen.runtime.disaggregation import scheduler_mixin

    return scheduler_mixin.create_transfer_engine


def test_factory_returns_the_adapter_engine_when_selected(sgl_model: str) -> None:
    from mooncake_diffusion_sglang.engine import MooncakeDiffusionTransferEngine
    from sglang.multimodal_gen.runtime.disaggregation.transport import engine as sgl_engine

    serve_args(
        sgl_model,
        "denoiser",
        "--disagg-transfer-backend",
        BACKEND,
        "--mooncake-diffusion-retries",
        "5",
    )
    assert sgl_engine.create_transfer_engine is _factory()  # hooked in both places
    engine = _factory()(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    try:
        assert isinstance(engine, MooncakeDiffusionTransferEngine)
        assert isinstance(engine, sgl_engine.BaseTransferEngine)
        assert engine.options.retries == 5  # the flag reached the engine
        assert not engine.supports_gpu_direct  # no CUDA here: a host pool
        assert engine.session_id.startswith("127.0.0.1:")
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["mooncake", "auto"])
def test_factory_returns_sglang_default_otherwise(sgl_model: str, backend: str) -> None:
    from sglang.multimodal_gen.runtime.disaggregation.transport.engine import (
        MooncakeDiffusionEngine,
    )

    serve_args(sgl_model, "denoiser", "--disagg-transfer-backend", backend)
    engine = _factory()(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    assert type(engine) is MooncakeDiffusionEngine
    assert engine.supports_gpu_direct  # sglang's own: always GPU memory
    del engine  # sglang's wrapper has no close(); its engine ends with the object

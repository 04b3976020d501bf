"""GenerationParams / PipelineConfig: validation, wire round trip, torch-free import."""

import subprocess
import sys

import pytest

from mooncake_diffusion.pipeline import (
    GenerationParams,
    ParamsError,
    PipelineConfig,
    decode_params,
    encode_params,
)

pytestmark = pytest.mark.unit


def test_importing_params_loads_no_torch():
    code = (
        "import sys, mooncake_diffusion.pipeline as p; p.GenerationParams; p.encode_params; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mooncake', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_round_trip_and_defaults():
    p = GenerationParams(prompt="a red fox", negative_prompt="blurry", seed=2**40, frames=21)
    assert decode_params(encode_params(p)) == p
    assert (p.steps, p.guidance, p.height, p.width, p.cfg, p.is_video) == (
        12,
        4.0,
        64,
        64,
        True,
        True,
    )
    assert p.latent_shape(PipelineConfig()) == (1, 4, 6, 8, 8)
    assert not GenerationParams(prompt="x", guidance=1.0).cfg


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("frames", 4, "1 \\+ 4k"),
        ("frames", 0, "1 \\+ 4k"),
        ("height", 40, "multiple of 16"),
        ("width", 4096, "multiple of 16"),
        ("steps", 0, "steps"),
        ("seed", -1, "seed"),
        ("guidance", float("nan"), "finite"),
    ],
)
def test_bad_params_raise_params_error(field, value, match):
    with pytest.raises(ParamsError, match=match):
        GenerationParams(prompt="x", **{field: value})


def test_bad_bytes_raise_params_error():
    import msgspec

    with pytest.raises(ParamsError, match="frames"):
        decode_params(msgspec.msgpack.encode({"prompt": "x", "frames": 2}))
    with pytest.raises(ParamsError, match="not generation params"):
        decode_params(b"\xc1")
    with pytest.raises(ParamsError):
        decode_params(msgspec.msgpack.encode({"seed": 1}))  # no prompt


def test_config_validation_and_model_id():
    assert PipelineConfig().model_id() == PipelineConfig().model_id()
    assert PipelineConfig().model_id().startswith("mcd-reference@")
    assert PipelineConfig(threads=2).model_id() != PipelineConfig().model_id()
    with pytest.raises(ParamsError, match="multiple of 6"):
        PipelineConfig(dit_dim=64)
    with pytest.raises(ParamsError, match="dit_depth"):
        PipelineConfig(dit_depth=0)

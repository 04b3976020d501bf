"""The plugin against the stand-in, in this process: entry-point loading, routing,
the stand-in's honesty, and the verification script. No Mooncake needed."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import lightx2v  # noqa: F401  (the stand-in; loads the installed platform plugin)
import pytest
from lightx2v.disagg import disagg_mixin
from lightx2v.infer import init_runner
from lightx2v.models.runners.wan.wan_runner import WanRunner
from lightx2v_platform import set_ai_device
from mooncake_diffusion_lightx2v import plugin
from mooncake_diffusion_lightx2v.check import EXPECTED_PARAMS

pytestmark = pytest.mark.engines


def test_standin_exposes_exactly_the_methods_the_plugin_patches():
    public = {
        name
        for name, value in vars(disagg_mixin.DisaggMixin).items()
        if callable(value) and not name.startswith("_")
    }
    assert public == set(plugin.PATCHED)
    assert set(EXPECTED_PARAMS) == set(plugin.PATCHED)
    for name, want in EXPECTED_PARAMS.items():
        method = getattr(disagg_mixin.DisaggMixin, name)
        original = getattr(method, "__mooncake_diffusion_original__", None)
        assert original is not None, f"{name} is not routed"
        assert list(inspect.signature(original).parameters) == want


def test_import_lightx2v_loads_the_plugin_and_patches_after_the_device_is_set():
    assert "mooncake_diffusion" in set_ai_device.LOADED_PLUGINS
    assert set_ai_device.FAILED_PLUGINS == []
    assert plugin.patched(disagg_mixin.DisaggMixin) == list(plugin.PATCHED)
    # the plugin imported nothing of LightX2V early: the mixin module saw the device
    assert disagg_mixin.DEVICE_AT_IMPORT == "cpu"
    assert issubclass(WanRunner, disagg_mixin.DisaggMixin)
    assert all(n not in vars(WanRunner) for n in plugin.PATCHED)  # inherited, so routed


@pytest.mark.parametrize(
    "disagg_config",
    [None, {}, {"transfer_backend": "mooncake"}, {"transfer_backend": "Mooncake_Diffusion"}],
    ids=["no-disagg_config", "empty", "mooncake", "wrong-case"],
)
def test_any_other_backend_runs_lightx2v_unchanged(disagg_config):
    config = {"model_cls": "wan2.1", "task": "i2v", "disagg_mode": "transformer"}
    if disagg_config is not None:
        config["disagg_config"] = {**disagg_config, "decoder_engine_rank": 2}
    runner = init_runner(config)
    runner.send_encoder_outputs({}, [])
    assert runner.receive_encoder_outputs() == {}
    runner.send_transformer_outputs(None)
    runner.receive_transformer_outputs()
    runner.release_disagg()
    assert runner.builtin_calls == list(plugin.PATCHED)
    assert getattr(runner, "_mcd", None) is None
    if disagg_config is not None:
        assert runner._disagg_p2_sender == "builtin Phase 2 sender"


def test_patch_is_idempotent_and_unpatch_restores():
    class Mixin:
        def init_disagg(self, config):
            return "lightx2v"

        def send_encoder_outputs(self, inputs, latent_shape): ...
        def receive_encoder_outputs(self): ...
        def send_transformer_outputs(self, latents): ...
        def receive_transformer_outputs(self): ...
        def release_disagg(self): ...

    original = Mixin.__dict__["init_disagg"]
    plugin.patch(Mixin)
    routed = Mixin.__dict__["init_disagg"]
    plugin.patch(Mixin)
    assert Mixin.__dict__["init_disagg"] is routed is not original
    assert Mixin().init_disagg({"disagg_config": {"transfer_backend": "x"}}) == "lightx2v"
    plugin.unpatch(Mixin)
    assert Mixin.__dict__["init_disagg"] is original
    assert plugin.patched(Mixin) == []


def test_patch_refuses_an_unknown_runner_surface():
    class Older:
        def init_disagg(self, config): ...

    with pytest.raises(AttributeError, match="send_encoder_outputs"):
        plugin.patch(Older)
    assert plugin.patched(Older) == []


def test_verification_script_passes_on_the_standin():
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_diffusion_lightx2v.check"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok    routed by the plugin: 6 of 6" in out.stdout
    assert "ok    WanRunner inherits DisaggMixin" in out.stdout
    assert "ok    WanRunner has ['set_config', 'run_pipeline'] (queue mode)" in out.stdout
    assert "ok    lightx2v.utils.input_info.set_input_info('args',)" in out.stdout
    assert "FAIL" not in out.stdout

"""The plugin against the real LightX2V: the verification script on the real
checkout, a role selecting the adapter when the adapter cannot load, and the
patching rules on plain classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import role_argv, role_config
from mooncake_diffusion_lightx2v import plugin

pytestmark = [pytest.mark.engines, pytest.mark.timeout(1800)]


def test_verification_script_passes_on_the_real_checkout():
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_diffusion_lightx2v.check"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=1500,  # a hang guard: a role starts in minutes on a busy machine
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok    routed by the plugin: 6 of 6" in out.stdout
    for runner in ("WanRunner", "QwenImageRunner"):
        assert f"ok    {runner} inherits DisaggMixin" in out.stdout
        assert f"ok    {runner} has ['set_config', 'run_pipeline'] (queue mode)" in out.stdout
    assert "ok    lightx2v.utils.input_info.init_empty_input_info(" in out.stdout
    assert "ok    lightx2v.utils.input_info.update_input_info_from_dict(" in out.stdout
    assert "FAIL" not in out.stdout
    line = next(x for x in out.stdout.splitlines() if "source commit:" in x)
    # the source's own commit: a git checkout's, or an unpacked archive's by its name
    # (./dev installs it from either); never "unknown"
    assert "source commit: f8aee98b" in line and "(the targeted commit), from " in line, line


def test_a_role_selecting_the_adapter_fails_at_start_when_the_adapter_cannot_load(
    tmp_path, model_dir, mooncake_cluster
):
    """LightX2V only logs a plugin that fails; the adapter's own entry point still
    runs (stdlib only) and makes the role refuse LightX2V's built-in transfer."""
    broken = tmp_path / "shadow" / "mooncake_diffusion"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('core broken on purpose')\n")
    config = tmp_path / "encoder.json"
    config.write_text(json.dumps(role_config("encoder", mooncake_cluster)))
    path = os.pathsep.join([str(broken.parent), os.environ["PYTHONPATH"]])
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run(
        role_argv(config, model_dir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,  # a hang guard: a role starts in minutes on a busy machine
    )
    assert out.returncode == 1, out.stderr[-4000:]
    assert "AdapterNotActiveError" in out.stderr, out.stderr[-4000:]
    assert "core broken on purpose" in out.stderr
    assert mooncake_cluster.keys() == []


def mixin_class():
    class Mixin:
        def init_disagg(self, config):
            return "lightx2v"

        def send_encoder_outputs(self, inputs, latent_shape): ...
        def receive_encoder_outputs(self): ...
        def send_transformer_outputs(self, latents): ...
        def receive_transformer_outputs(self): ...
        def release_disagg(self): ...

    return Mixin


def test_patch_is_idempotent_and_unpatch_restores():
    Mixin = mixin_class()
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


def test_the_check_reports_the_lightx2v_sources_own_commit_never_its_surroundings(tmp_path):
    """The engine tier unpacks LightX2V inside this repository (``.venvs/src``): the
    check said ``checkout commit: <this repository's> (differs from f8aee98b)``."""
    from mooncake_diffusion_lightx2v.check import source_commit

    def git(where, *args):
        run = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    outer = tmp_path / "project"
    unpacked = outer / "src" / "lightx2v-f8aee98b" / "lightx2v"
    unpacked.mkdir(parents=True)
    (unpacked / "__init__.py").write_text("")
    git(outer, "init", "-q")
    git(
        outer,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "x",
    )
    assert source_commit(unpacked) is None  # not the project's commit
    checkout = unpacked.parent
    git(checkout, "init", "-q")
    git(checkout, "add", ".")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "src")
    assert source_commit(unpacked) == git(checkout, "rev-parse", "HEAD")
    assert source_commit(unpacked) != git(outer, "rev-parse", "HEAD")


def test_the_check_reports_an_unpacked_archives_commit_from_its_name(tmp_path):
    """A source unpacked from ``lightx2v-<commit>.tar.gz`` (into ``lightx2v-<commit>/``)
    has no git checkout of its own: the check printed its commit as unknown. It says
    the commit the archive's name gives, with the sha256 ``./dev`` checked when its
    stamp is there; a folder of any other name stays unknown."""
    from mooncake_diffusion_lightx2v import check

    top = tmp_path / "lightx2v-f8aee98b"
    package = top / "lightx2v"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert check.source_commit(package) is None
    got = check.archive_commit(package)
    assert got == ("f8aee98b", "the folder lightx2v-f8aee98b/ (an unpacked archive)")
    sha = "b10249290c0a763008cffc93cd16390e2ee9a6815d14c28626634f390fe994c2"
    (top / check.ARCHIVE_STAMP).write_text(f"lightx2v-f8aee98b.tar.gz {sha}\n")
    commit, where = check.archive_commit(package)
    assert commit == "f8aee98b"
    assert where == "the archive lightx2v-f8aee98b.tar.gz (sha256 b10249290c0a7630...)"
    line = check._commit_line(package)
    assert line == f"source commit: f8aee98b (the targeted commit), from {where}", line

    other = tmp_path / "lightx2v-0123abcd" / "lightx2v"
    other.mkdir(parents=True)
    assert check._commit_line(other).startswith("source commit: 0123abcd (differs from f8aee98b)")
    plain = tmp_path / "LightX2V" / "lightx2v"
    plain.mkdir(parents=True)
    assert check.archive_commit(plain) is None
    assert check._commit_line(plain) == (
        "source commit: unknown (neither a git checkout nor an unpacked archive)"
    )

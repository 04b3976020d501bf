"""`sglang serve`'s own argument parser, after sglang loaded the adapter's plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mooncake_diffusion_sglang.options import BACKEND, ENV, Options
from role_process import serve_args

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("clean_env")]


def test_parser_accepts_backend_and_adapter_flags(sgl_model: str, tmp_path) -> None:
    cfg = tmp_path / "mcd.yaml"
    cfg.write_text("retries: 7\ntimeout_s: 12.5\nsame_host: off\n")
    args = serve_args(
        sgl_model,
        "denoiser",
        "--disagg-transfer-backend",
        BACKEND,
        "--mooncake-diffusion-config",
        str(cfg),
        "--mooncake-diffusion-retries",
        "4",  # a flag wins over the file
        "--mooncake-diffusion-protocol",
        "tcp",
    )
    assert args.disagg_transfer_backend == BACKEND
    # exported for spawned workers: file values, overridden by flags
    exported = Options.from_env()
    assert exported == Options(retries=4, timeout_s=12.5, same_host="off", protocol="tcp")
    assert json.loads(os.environ[ENV])["retries"] == 4


def test_sglang_backends_still_parse(sgl_model: str) -> None:
    args = serve_args(sgl_model, "denoiser", "--disagg-transfer-backend", "mooncake")
    assert args.disagg_transfer_backend == "mooncake"
    assert ENV not in os.environ  # nothing exported: the adapter is not selected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--disagg-transfer-backend", "mooncake-difusion"], "invalid choice: 'mooncake-difusion'"),
        (["--mooncake-diffusion-same-host", "maybe"], "invalid choice: 'maybe'"),
        (["--mooncake-diffusion-retires", "3"], "unrecognized arguments: --mooncake-diffusion"),
    ],
    ids=["misspelled-backend", "bad-choice", "misspelled-flag"],
)
def test_parser_rejects_misspellings(
    sgl_model: str, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_args(sgl_model, "denoiser", *extra)
    shown = capsys.readouterr().err + str(exc.value.code)
    assert message in shown, shown


def test_adapter_flags_need_the_backend(sgl_model: str) -> None:
    with pytest.raises(SystemExit, match=f"need.*--disagg-transfer-backend {BACKEND}"):
        serve_args(sgl_model, "denoiser", "--mooncake-diffusion-retries", "2")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("retries: 3\nretires: 4\n", "unknown field `retires`"),
        ("retries: 0\n", "retries must be at least 1"),
        ("pool: gpu\n", "pool"),
    ],
    ids=["unknown-key", "bad-value", "bad-choice"],
)
def test_config_file_errors_name_the_key(sgl_model: str, tmp_path, text: str, message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as exc:
        serve_args(
            sgl_model,
            "denoiser",
            "--disagg-transfer-backend",
            BACKEND,
            "--mooncake-diffusion-config",
            str(cfg),
        )
    assert message in str(exc.value.code) and "known keys" in str(exc.value.code)
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit, match="No such file"):
        serve_args(
            sgl_model,
            "denoiser",
            "--disagg-transfer-backend",
            BACKEND,
            "--mooncake-diffusion-config",
            str(missing),
        )


def test_sglang_serve_command_rejects_a_misspelled_backend(sgl_model: str) -> None:
    """The real `sglang serve` entry point, in its own process: the plugin loads there
    (the choice list names the adapter) and a misspelled value fails like any other."""
    sglang = os.path.join(os.path.dirname(sys.executable), "sglang")
    argv = [sglang, "serve", "--model-path", sgl_model, "--disagg-role", "denoiser"]
    argv += ["--disagg-server-addr", "tcp://127.0.0.1:5999"]
    # a hang guard, not a bound: sglang's imports took 72 s idle and over 240 s at
    # load average 8 (stress-ng plus a second suite); ./dev test --under-load's
    # per-test guard is 900 s
    done = subprocess.run(
        [*argv, "--disagg-transfer-backend", "mooncake-difusion"],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "invalid choice: 'mooncake-difusion'" in done.stderr
    assert f"'{BACKEND}'" in done.stderr  # the adapter's value is among the choices

"""LightX2V adapter tests against the real LightX2V source (``./dev engines lightx2v``
installs it editable from the archive named in
``packages/lightx2v_adapter/engine/archive.txt``), and a factory for role processes.

Each role process runs LightX2V's own server worker with the real runners; only
the model loaders are replaced (``fakes.py``), and ``cpu_platform/`` registers a
CPU platform through LightX2V's own ``lightx2v.platform_plugins`` hook. The
adapter is the installed workspace package, so its entry point is real too.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from mooncake_diffusion import MooncakeSettings
from mooncake_diffusion.childproc import JsonLinesChild
from mooncake_diffusion.testing import assert_no_leaks

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CPU_PLATFORM = HERE / "cpu_platform"
for path in (str(HERE), str(CPU_PLATFORM)):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(CPU_PLATFORM), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ["PLATFORM"] = "cpu"

#: The environment of role processes names a master that is not there, so a
#: role reaches the cluster only through its JSON's ``disagg_config``.
NOWHERE = MooncakeSettings(master="127.0.0.1:1", admin="127.0.0.1:2")

#: A small Wan I2V geometry (CPU-friendly): latents [16, 3, 8, 12].
SMALL = {
    "text_len": 16,
    "text_encoder_dim": 32,
    "target_video_length": 9,
    "target_height": 64,
    "target_width": 96,
    "infer_steps": 3,
    "sample_shift": 5.0,
    "sample_guide_scale": 5.0,
    "enable_cfg": False,
    "clip_embed_dim": 329216,
    "vae_z_dim": 16,
}
#: What LightX2V reads from the model folder's config.json (the DiT's geometry).
MODEL_CONFIG = {"dim": 64, "num_heads": 4, "in_dim": 36, "out_dim": 16, "num_layers": 1}


def role_config(mode: str | None, cluster, **disagg) -> dict:
    """A LightX2V role JSON that selects the adapter, on ``cluster`` (``mode``
    ``None``: LightX2V's colocated pipeline, no disaggregation)."""
    if mode is None:
        return dict(SMALL)
    base = {"transfer_backend": "mooncake_diffusion", "timeout_s": 120}
    base["master"] = cluster.settings.master
    base["admin"] = cluster.settings.admin_address
    return {"disagg_mode": mode, **SMALL, "disagg_config": {**base, **disagg}}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return d


@pytest.fixture
def image(tmp_path) -> Path:
    """A 64x96 RGB input image."""
    import numpy as np
    from PIL import Image

    path = tmp_path / "in.png"
    pixels = (np.arange(64 * 96 * 3) % 251).astype("uint8").reshape(64, 96, 3)
    Image.fromarray(pixels).save(path)
    return path


def role_argv(config_path: Path, model_dir: Path, task: str = "i2v") -> list[str]:
    worker = str(HERE / "role_worker.py")
    paths = ["--model_path", str(model_dir), "--config_json", str(config_path)]
    return [sys.executable, worker, "--task", task, *paths]


@pytest.fixture
def spawn_role(tmp_path, model_dir, mooncake_cluster):
    """``spawn_role(name, config)`` -> a role process running LightX2V's server
    worker with ``config`` as its ``--config_json``. Every role is released and
    reaped at teardown, then no store key may be left."""
    made: list[JsonLinesChild] = []

    def spawn(name: str, config: dict) -> JsonLinesChild:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        child = JsonLinesChild(role_argv(path, model_dir), NOWHERE, name)
        made.append(child)
        return child

    yield spawn

    def release(child: JsonLinesChild) -> None:
        if child.proc.poll() is None:
            assert child.request(op="release")["ok"]
        child.close()

    closers = [threading.Thread(target=release, args=(c,)) for c in made]
    for t in closers:  # each role's Mooncake clients take ~1 s to close: in parallel
        t.start()
    for t in closers:
        t.join(120)
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    assert_no_leaks(mooncake_cluster, threads)  # store keys here; threads: the root's check


def ok(reply: dict) -> dict:
    assert reply.get("ok"), reply
    return reply


def request(image: Path, seed: int, **extra) -> dict:
    """The body a client POSTs to LightX2V's server for one i2v request."""
    return {"prompt": f"a red kite, take {seed}", "image_path": str(image), "seed": seed} | extra

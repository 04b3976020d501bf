"""LightX2V adapter tests: the stand-in ``lightx2v`` (``standin/``) importable here
and in every child process, and a factory for role processes.

LightX2V is not on PyPI; ``standin/`` models the runner surface the adapter
patches (see ``standin/lightx2v/__init__.py``). The adapter itself is the
installed workspace package, so its ``lightx2v.platform_plugins`` entry point
is real and the stand-in loads it the way LightX2V does.
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
STANDIN = HERE / "standin"
for path in (str(HERE), str(STANDIN)):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(STANDIN), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("PLATFORM", "cpu")

#: The environment of role processes names a master that is not there, so a
#: role reaches the cluster only through its JSON's ``disagg_config``.
NOWHERE = MooncakeSettings(master="127.0.0.1:1", admin="127.0.0.1:2")

#: A small Wan I2V geometry (CPU-friendly); the full Wan 480p one is in the tests.
SMALL = {
    "text_len": 64,
    "text_encoder_dim": 256,
    "vae_z_dim": 16,
    "vae_stride": [4, 8, 8],
    "target_video_length": 17,
    "target_height": 64,
    "target_width": 96,
    "clip_embed_dim": 329216,
}


def role_config(mode: str, cluster, **disagg) -> dict:
    """A LightX2V role JSON that selects the adapter, on ``cluster``."""
    base = {"transfer_backend": "mooncake_diffusion"}
    base["master"] = cluster.settings.master
    base["admin"] = cluster.settings.admin_address
    return {"disagg_mode": mode, **SMALL, "disagg_config": {**base, **disagg}}


@pytest.fixture
def spawn_role(tmp_path, mooncake_cluster):
    """``spawn_role(name, config, task="i2v")`` -> a role process running the stand-in
    with ``config`` written as its ``--config_json``. Every role is released and
    reaped at teardown, then no store key may be left."""
    made: list[JsonLinesChild] = []

    def spawn(name: str, config: dict, task: str = "i2v") -> JsonLinesChild:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        argv = [sys.executable, str(HERE / "role_worker.py"), "--task", task]
        child = JsonLinesChild([*argv, "--config_json", str(path)], NOWHERE, name)
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
        t.join(60)
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    assert_no_leaks(mooncake_cluster, threads)  # store keys here; threads: the root's check

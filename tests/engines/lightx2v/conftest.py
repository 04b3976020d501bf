"""LightX2V adapter tests against the real LightX2V source (``./dev engines lightx2v``
installs it editable at the commit named in
``packages/lightx2v_adapter/engine/source.txt``), and a factory for role processes.

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
import time
from pathlib import Path
from typing import Any

import pytest

from mooncake_diffusion import MooncakeSettings
from mooncake_diffusion.platform.childproc import JsonLinesChild
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


#: A small Qwen-Image T2I geometry: 64x96 pixels, packed latents [1, 24, 64].
QWEN_SMALL = {
    "target_height": 64,
    "target_width": 96,
    "infer_steps": 3,
    "sample_shift": 3.0,
    "enable_cfg": False,
}
#: What LightX2V reads from a Qwen-Image model folder: transformer/config.json
#: (geometry), vae/config.json (vae_scale_factor 2**3 = 8) and the scheduler's.
QWEN_FILES = {
    "transformer/config.json": {"in_channels": 64, "joint_attention_dim": 32},
    "vae/config.json": {"temperal_downsample": [False, True, True]},
    "scheduler/scheduler_config.json": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
    },
}


def qwen_config(mode: str | None, cluster, **disagg) -> dict:
    """A Qwen-Image T2I role JSON (``role_config`` with the Qwen geometry)."""
    config = role_config(mode, cluster, **disagg)
    for key in SMALL:
        config.pop(key, None)
    return {**config, **QWEN_SMALL}


def write_model_dir(d: Path, model_cls: str = "wan2.1") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    if model_cls == "qwen_image":
        for name, content in QWEN_FILES.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(json.dumps(content))
    else:
        (d / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return d


def write_image(path: Path) -> Path:
    """A 64x96 RGB input image."""
    import numpy as np
    from PIL import Image

    pixels = (np.arange(64 * 96 * 3) % 251).astype("uint8").reshape(64, 96, 3)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return write_model_dir(tmp_path / "model")


@pytest.fixture
def image(tmp_path) -> Path:
    return write_image(tmp_path / "in.png")


@pytest.fixture(scope="module")
def module_image(tmp_path_factory) -> Path:
    return write_image(tmp_path_factory.mktemp("image") / "in.png")


def role_argv(
    config_path: Path, model_dir: Path, task: str = "i2v", model_cls: str = "wan2.1"
) -> list[str]:
    worker = str(HERE / "role_worker.py")
    paths = ["--model_path", str(model_dir), "--config_json", str(config_path)]
    return [sys.executable, worker, "--model_cls", model_cls, "--task", task, *paths]


def _release_all(children: list[JsonLinesChild]) -> None:
    def release(child: JsonLinesChild) -> None:
        if child.proc.poll() is None:
            assert child.request(op="release")["ok"]
        child.close()

    closers = [threading.Thread(target=release, args=(c,)) for c in children]
    for t in closers:  # each role's Mooncake clients take ~1 s to close: in parallel
        t.start()
    for t in closers:
        t.join(120)


@pytest.fixture
def spawn_role(tmp_path, model_dir, mooncake_cluster):
    """``spawn_role(name, config)`` -> a role process of its own for this test
    (one the test kills or starts broken), running LightX2V's server worker with
    ``config`` as its ``--config_json``. Every role is released and reaped at
    teardown, then no store key may be left."""
    made: list[JsonLinesChild] = []

    def spawn(name: str, config: dict) -> JsonLinesChild:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        child = JsonLinesChild(role_argv(path, model_dir), NOWHERE, name)
        made.append(child)
        return child

    yield spawn
    _release_all(made)
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    assert_no_leaks(mooncake_cluster, threads)  # store keys here; threads: the root's check


class RolePool:
    """Role processes started once per test module and shared by its tests (each
    imports LightX2V and loads its runner: the slow part of these tests).

    ``get(name, config)`` starts ``name`` on first use and returns the running one
    after; a test that kills a role or needs a fresh channel uses ``spawn_role``
    instead. ``check()`` runs after every test that used the pool: the store
    holds no key (once in-flight releases have landed), and every live role has
    no publication left, no receive-pool bytes in use and no more threads than
    after its first test. ``close()`` releases and reaps them all."""

    #: hang guard for asynchronous releases (the orchestrator's Release) to land
    SETTLE_S = 600.0

    def __init__(self, root: Path, cluster: Any) -> None:
        self.root = root
        self.cluster = cluster
        self.roles: dict[str, JsonLinesChild] = {}
        self.threads: dict[str, int] = {}
        self.model_dirs: dict[str, Path] = {}

    def model_dir(self, model_cls: str) -> Path:
        if model_cls not in self.model_dirs:
            self.model_dirs[model_cls] = write_model_dir(
                self.root / f"model-{model_cls}", model_cls
            )
        return self.model_dirs[model_cls]

    def get(
        self, name: str, config: dict, task: str = "i2v", model_cls: str = "wan2.1"
    ) -> JsonLinesChild:
        child = self.roles.get(name)
        if child is not None and child.proc.poll() is None:
            return child
        path = self.root / f"{name}.json"
        path.write_text(json.dumps(config))
        argv = role_argv(path, self.model_dir(model_cls), task, model_cls)
        child = self.roles[name] = JsonLinesChild(argv, NOWHERE, name)
        return child

    def start(self, specs: dict[str, tuple]) -> dict[str, JsonLinesChild]:
        """``get`` each ``name: (config, [task, [model_cls]])``; the children start
        at once (each ``JsonLinesChild`` starts its process when made)."""
        return {name: self.get(name, *spec) for name, spec in specs.items()}

    def check(self) -> None:
        deadline = time.monotonic() + self.SETTLE_S
        while True:
            keys = self.cluster.keys()
            infos = {
                name: ok(child.request(op="info"))
                for name, child in self.roles.items()
                if child.proc.poll() is None
            }
            held = {
                name: (i["live_publications"], i["pool_bytes_in_use"])
                for name, i in infos.items()
                if i["adapter"] and (i["live_publications"] or i["pool_bytes_in_use"])
            }
            if (not keys and not held) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not keys, f"store keys left behind: {keys[:10]}"
        assert not held, f"publications / pool bytes still held: {held}"
        for name, info in infos.items():
            count = len(info["threads"])
            first = self.threads.setdefault(name, count)
            assert count <= first, f"{name}: {count} threads, {first} after its first test"

    def close(self) -> None:
        _release_all(list(self.roles.values()))


@pytest.fixture(scope="module")
def roles(tmp_path_factory, mooncake_cluster):
    """The module's ``RolePool``; at the end of the module, no store key may be left."""
    pool = RolePool(tmp_path_factory.mktemp("roles"), mooncake_cluster)
    yield pool
    pool.close()
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    assert_no_leaks(mooncake_cluster, threads)


@pytest.fixture(autouse=True)
def _role_pool_leak_check(request):
    """After each test that used the module's ``roles``: ``RolePool.check``."""
    yield
    if "roles" in request.fixturenames:
        request.getfixturevalue("roles").check()


def ok(reply: dict) -> dict:
    assert reply.get("ok"), reply
    return reply


def request(image: Path, seed: int, **extra) -> dict:
    """The body a client POSTs to LightX2V's server for one i2v request."""
    return {"prompt": f"a red kite, take {seed}", "image_path": str(image), "seed": seed} | extra


class RoleGate:
    """The test's side of ``fakes.hold``: ``ask(rid, step)`` is the request field
    that holds ``rid`` at denoising ``step`` in whichever role gets there first;
    ``wait_reached`` returns what that role wrote (its queue ``worker_id``, the
    step, its pid); ``release`` lets it go on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def ask(self, rid: str, step: int) -> dict:
        return {"test_gate": {"dir": str(self.root), "rid": rid, "step": step}}

    def wait_reached(self, rid: str, hang_guard: float = 600.0) -> dict:
        path = self.root / f"{rid}.reached"
        deadline = time.monotonic() + hang_guard
        while time.monotonic() < deadline:
            try:
                text = path.read_text()
            except FileNotFoundError:
                text = ""
            if text.endswith("}"):  # written whole: the holder is waiting
                return json.loads(text)
            time.sleep(0.01)
        raise AssertionError(f"{rid} never reached its gate")

    def release(self, rid: str) -> None:
        (self.root / f"{rid}.released").touch()

"""Step checkpoints against a real master and store host: save in one process, SIGKILL it
mid-job, resume in another, and end in the bytes of an uninterrupted run.

Every test ends with the store holding exactly the keys it held before and no
registration left in flight; the autouse thread check of ``conftest.py`` runs last.
"""

import signal
import time

import msgspec
import pytest
import torch

from mooncake_diffusion.caches import CheckpointCache
from mooncake_diffusion.errors import MooncakeDiffusionError, PayloadError
from mooncake_diffusion.pipeline import (
    DenoisePreempted,
    GenerationParams,
    PipelineConfig,
    ReferencePipeline,
    SamplerState,
    denoise_with_checkpoints,
)
from mooncake_diffusion.pipeline.checkpointing import checkpoint_job_of
from mooncake_diffusion.pipeline.worker import DenoiseProcess, digest

pytestmark = pytest.mark.integration

CONFIG = PipelineConfig(dit_dim=48, dit_depth=2, vae_channels=8, text_dim=32)
PARAMS = GenerationParams(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    seed=5,
    steps=9,
    frames=9,
    height=32,
    width=32,
)


def wait_for_keys(cluster, expected, timeout=5.0):
    deadline = time.monotonic() + timeout
    while sorted(cluster.keys()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(cluster.keys())


@pytest.fixture
def store_baseline(mooncake_cluster):
    before = sorted(mooncake_cluster.keys())
    yield before
    assert wait_for_keys(mooncake_cluster, before) == before


@pytest.fixture(scope="module")
def pipe():
    return ReferencePipeline(CONFIG)


@pytest.fixture
def make_cache(mooncake_cluster, store_baseline, pipe):
    made = []

    def make(**kw):
        kw.setdefault("model_id", pipe.model_id)
        kw.setdefault("sampler", pipe.sampler)
        cache = CheckpointCache(mooncake_cluster.settings, **kw)
        made.append((cache, cache.client.regs.count))
        return cache

    yield make
    for cache, regs in made:
        assert cache.client.regs.temporary == 0, "registration left in flight"
        assert cache.client.regs.count == regs, "registration left behind"
        cache.clear()
        cache.close()


def job_keys(cluster, job):
    keys = cluster.keys()  # a list: the cluster is no mapping
    return sorted(k for k in keys if k.startswith(job.prefix))


def test_sigkilled_worker_resumes_in_another_process_bitwise(
    mooncake_cluster, make_cache, pipe, store_baseline
):
    cond = pipe.condition(PARAMS)
    full = pipe.denoise(cond, PARAMS)
    want = {"latent_sha256": digest(full), "frames_sha256": digest(pipe.decode(full))}
    cmd = {
        "params": msgspec.structs.asdict(PARAMS),
        "config": msgspec.structs.asdict(CONFIG),
        "every": 2,
    }
    first = DenoiseProcess(mooncake_cluster.settings)
    with pytest.raises(MooncakeDiffusionError, match="exited"):
        first.request(op="denoise", die_after=5, **cmd)
    first.close()
    assert first.proc.returncode == -signal.SIGKILL

    cache = make_cache(every=2)
    job = checkpoint_job_of(cache, pipe, PARAMS)
    # keep=1: only the newest checkpoint (after step 4) is left, data + metadata
    assert job_keys(mooncake_cluster, job) == sorted([job.key(4) + "/data", job.key(4) + "/meta"])
    step, tensors = cache.latest(job)
    assert step == 4 and int(tensors["step"]) == 4

    with DenoiseProcess(mooncake_cluster.settings) as second:
        r = second.request(op="denoise", **cmd)
        assert r["ok"], r
        assert r["resumed_from"] == 4
        assert r["steps_run"] == [5, 6, 7, 8, 9]  # not from step 0
        assert r["saved"] == [6, 8]
        assert {k: r[k] for k in want} == want  # bitwise the uninterrupted run
        assert job_keys(mooncake_cluster, job) == sorted(
            [job.key(8) + "/data", job.key(8) + "/meta"]
        )
        done = second.request(op="finish", **cmd)
    assert done["removed"] == 2
    assert job_keys(mooncake_cluster, job) == []
    assert wait_for_keys(mooncake_cluster, store_baseline) == store_baseline


def test_preempted_job_resumes_from_its_checkpoint(mooncake_cluster, make_cache, pipe):
    cond = pipe.condition(PARAMS)
    full = pipe.denoise(cond, PARAMS)
    cache = make_cache(every=3)
    with pytest.raises(DenoisePreempted) as info:
        denoise_with_checkpoints(pipe, cache, cond, PARAMS, should_stop=lambda k: k == 4)
    assert info.value.state.step == 4
    other = ReferencePipeline(CONFIG)  # another worker, same weights
    steps = []
    res = denoise_with_checkpoints(
        other,
        cache,
        other.condition(PARAMS),
        PARAMS,
        finish=True,
        on_step=lambda k, s: steps.append(k),
    )
    assert res.resumed_from == 3 and steps == [4, 5, 6, 7, 8, 9] and res.saved == (6,)
    assert digest(res.latent) == digest(full)
    assert job_keys(mooncake_cluster, res.job) == []
    assert cache.stats().errors == 0


def test_edit_and_resume_continues_another_prompt_from_a_mid_trajectory_checkpoint(
    mooncake_cluster, make_cache, pipe
):
    """Edit-and-resume: a mid-trajectory state of request A, read back from the store,
    continued under an edited prompt B. Deterministic, and neither A's output nor B's
    from scratch (the first steps were A's)."""
    cache = make_cache(every=3)
    with pytest.raises(DenoisePreempted):
        denoise_with_checkpoints(
            pipe, cache, pipe.condition(PARAMS), PARAMS, should_stop=lambda k: k == 4
        )
    job = checkpoint_job_of(cache, pipe, PARAMS)
    step, _ = cache.latest(job)
    assert step == 3
    edited = msgspec.structs.replace(PARAMS, prompt="a grey wolf in the snow")
    cond = pipe.condition(edited)

    def resume() -> torch.Tensor:
        state = SamplerState.from_tensors(cache.load(job, step))
        return pipe.denoise(cond, edited, resume=state)

    first, again = resume(), resume()
    assert digest(first) == digest(again)
    assert digest(first) != digest(pipe.denoise(cond, edited))
    assert digest(first) != digest(pipe.denoise(pipe.condition(PARAMS), PARAMS))
    assert cache.finish(job) >= 1


def test_save_load_latest_keep_and_finish(mooncake_cluster, make_cache, pipe):
    cache = make_cache(every=2, keep=2)
    job = checkpoint_job_of(cache, pipe, PARAMS)
    assert cache.latest(job) is None
    assert [s for s in range(10) if cache.due(job, s)] == [2, 4, 6, 8]
    assert cache.due_steps(job) == [8, 6, 4, 2]
    latent = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    for s in (2, 4, 6):
        assert cache.save(job, s, {"latent": latent + s, "step": torch.tensor([s])})
    # keep=2: steps 4 and 6 remain
    assert cache.load(job, 2) is None
    assert torch.equal(cache.load(job, 4)["latent"], latent + 4)
    step, t = cache.latest(job)
    assert step == 6 and torch.equal(t["latent"], latent + 6)
    # the newest gone (evicted, say): latest falls back to the older one
    cache._entries.remove(job.key(6))
    assert cache.latest(job)[0] == 4
    # another job of the same model is separate
    other = cache.job(cond_key="x", seed=1, guidance=1.0, steps=9, shape=[2, 16])
    assert cache.save(other, 2, latent)
    assert cache.finish(job) == 2
    assert cache.latest(job) is None and cache.latest(other)[0] == 2
    assert cache.finish(other) == 2
    with pytest.raises(PayloadError):
        cache.save(job, 2, {"latent": latent.t()})  # not contiguous
    s = cache.stats()
    assert (s.puts, s.errors) == (4, 0) and s.hits >= 4

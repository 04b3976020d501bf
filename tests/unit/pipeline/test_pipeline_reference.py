"""The reference pipeline: determinism, resume from any step, chunked causal decode.

Pure computation in this process (plus one child process for cross-process
determinism); no Mooncake. Small sizes keep each test well under a second.
"""

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from mooncake_diffusion.pipeline import (
    DenoisePreempted,
    GenerationParams,
    PipelineConfig,
    ReferencePipeline,
    SamplerState,
)

pytestmark = pytest.mark.unit

CONFIG = PipelineConfig(dit_dim=48, dit_depth=2, vae_channels=8, text_dim=32)
VIDEO = GenerationParams(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    seed=11,
    steps=6,
    frames=13,
    height=32,
    width=48,
)
IMAGE = GenerationParams(prompt="a lighthouse", negative_prompt="blurry", seed=3, steps=5)


@pytest.fixture(scope="module")
def pipe():
    return ReferencePipeline(CONFIG)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def wire(state: SamplerState) -> SamplerState:
    """The state through raw bytes (what a checkpoint does), nothing shared with the input."""
    out = {}
    for name, t in state.to_tensors().items():
        raw = t.numpy().tobytes()
        out[name] = torch.from_numpy(np.frombuffer(raw, dtype=t.numpy().dtype).copy()).reshape(
            t.shape
        )
    return SamplerState.from_tensors(out)


def test_shapes_and_dtypes(pipe):
    cond = pipe.condition(VIDEO)
    assert cond["prompt_embeds"].shape == (1, CONFIG.text_len, CONFIG.text_dim)
    assert cond["negative_embeds"].shape == cond["prompt_embeds"].shape
    latent = pipe.denoise(cond, VIDEO)
    assert latent.shape == VIDEO.latent_shape(CONFIG) == (1, 4, 4, 4, 6)
    frames = pipe.decode(latent)
    assert frames.dtype == torch.uint8 and frames.shape == (13, 32, 48, 3)
    assert frames.float().std() > 5  # not a constant image
    image = pipe.run_colocated(IMAGE)
    assert image.shape == (1, 64, 64, 3)


def test_same_seed_same_bytes_in_two_pipelines(pipe):
    other = ReferencePipeline(CONFIG)
    assert digest(pipe.run_colocated(VIDEO)) == digest(other.run_colocated(VIDEO))


def test_same_bytes_in_another_process(pipe):
    code = (
        "import hashlib, torch\n"
        "from mooncake_diffusion.pipeline import GenerationParams, PipelineConfig, "
        "ReferencePipeline\n"
        f"cfg = PipelineConfig(**{__import__('msgspec').structs.asdict(CONFIG)!r})\n"
        f"p = GenerationParams(**{__import__('msgspec').structs.asdict(VIDEO)!r})\n"
        "f = ReferencePipeline(cfg).run_colocated(p)\n"
        "print(hashlib.sha256(f.numpy().tobytes()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest(pipe.run_colocated(VIDEO))


def test_deterministic_switches_kernels_without_loading_the_compiler():
    # torch.use_deterministic_algorithms imports inductor and dynamo (2-8 s a worker
    # process); the pipeline sets only the kernel switch, and restores what it found
    code = (
        "import sys, torch\n"
        "from mooncake_diffusion.pipeline.runtime import deterministic\n"
        "torch.set_deterministic_debug_mode('warn')\n"
        "with deterministic(threads=1):\n"
        "    inside = (torch.are_deterministic_algorithms_enabled(),\n"
        "              torch.is_deterministic_algorithms_warn_only_enabled())\n"
        "after = (torch.are_deterministic_algorithms_enabled(),\n"
        "         torch.is_deterministic_algorithms_warn_only_enabled())\n"
        "print(inside, after, 'torch._inductor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "(True, False) (True, True) False"


def test_seed_prompt_and_guidance_change_the_output(pipe):
    base = digest(pipe.run_colocated(IMAGE))
    variants = [
        GenerationParams(**{**_fields(IMAGE), "seed": 4}),
        GenerationParams(**{**_fields(IMAGE), "prompt": "a lighthouse at night"}),
        GenerationParams(**{**_fields(IMAGE), "negative_prompt": "noisy"}),
        GenerationParams(**{**_fields(IMAGE), "guidance": 1.0}),
        GenerationParams(**{**_fields(IMAGE), "steps": 6}),
    ]
    digests = {digest(pipe.run_colocated(v)) for v in variants}
    assert base not in digests and len(digests) == len(variants)
    other_weights = ReferencePipeline(PipelineConfig(**{**_fields(CONFIG), "weights_seed": 1}))
    assert digest(other_weights.run_colocated(IMAGE)) != base
    assert other_weights.model_id != pipe.model_id


def _fields(s):
    import msgspec

    return msgspec.structs.asdict(s)


def test_embeddings_are_per_prompt(pipe):
    cond = pipe.condition(VIDEO)
    assert torch.equal(cond["negative_embeds"], pipe.encode("blurry")["embeds"])
    assert torch.equal(cond["prompt_embeds"], pipe.encode(VIDEO.prompt)["embeds"])
    no_cfg = GenerationParams(**{**_fields(VIDEO), "guidance": 1.0})
    assert set(pipe.condition(no_cfg)) == {"prompt_embeds"}


@pytest.mark.parametrize("params", [VIDEO, IMAGE], ids=["video", "image"])
def test_resume_from_every_step_equals_the_full_run(pipe, params):
    cond = pipe.condition(params)
    states: list[SamplerState] = []
    full = pipe.denoise(cond, params, on_step=lambda k, s: states.append(wire(s)))
    assert [s.step for s in states] == list(range(1, params.steps + 1))
    for state in [wire(pipe.initial_state(params)), *states]:
        resumed = pipe.denoise(cond, params, resume=state)
        assert digest(resumed) == digest(full), f"resume from step {state.step}"
    # a resume from a mid-run state really skips the earlier steps
    calls = []
    pipe.denoise(cond, params, resume=states[2], on_step=lambda k, s: calls.append(k))
    assert calls == list(range(4, params.steps + 1))


def test_preempt_at_a_step_boundary_and_resume(pipe):
    cond = pipe.condition(VIDEO)
    full = pipe.denoise(cond, VIDEO)
    with pytest.raises(DenoisePreempted) as info:
        pipe.denoise(cond, VIDEO, should_stop=lambda k: k == 4)
    state = info.value.state
    assert state.step == 4 and not state.done
    assert digest(pipe.denoise(cond, VIDEO, resume=wire(state))) == digest(full)


def test_resume_rejects_a_state_of_another_request(pipe):
    cond = pipe.condition(VIDEO)
    state = pipe.initial_state(IMAGE)
    with pytest.raises(ValueError, match="latent"):
        pipe.denoise(cond, VIDEO, resume=state)
    longer = GenerationParams(**{**_fields(VIDEO), "steps": 7})
    with pytest.raises(ValueError, match="schedule"):
        pipe.denoise(cond, VIDEO, resume=pipe.initial_state(longer))
    bad = {**pipe.initial_state(VIDEO).to_tensors(), "step": torch.tensor([99])}
    with pytest.raises(ValueError, match="outside"):
        SamplerState.from_tensors(bad)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 9])
def test_chunked_causal_decode_equals_the_whole_decode(pipe, chunks):
    latent = pipe.denoise(pipe.condition(VIDEO), VIDEO)
    whole = pipe.decode(latent)
    parts = list(pipe.decode_chunks(latent, chunks))
    assert len(parts) == min(chunks, latent.shape[2])
    assert all(p.shape[0] >= 1 for p in parts) and sum(p.shape[0] for p in parts) == 13
    assert digest(torch.cat(parts)) == digest(whole)


def test_decode_is_causal_and_the_cache_matters(pipe):
    latent = pipe.denoise(pipe.condition(VIDEO), VIDEO)
    whole = pipe.decode(latent)
    # changing the last latent frame changes only the last 4 frames
    changed = latent.clone()
    changed[:, :, -1] += 1.0
    other = pipe.decode(changed)
    assert torch.equal(other[:-4], whole[:-4]) and not torch.equal(other[-4:], whole[-4:])
    # decoding the second half without the first half's cache gives other bytes
    stream = pipe.decode_stream()
    pipe.decode_feed(stream, latent[:, :, :2])
    carried = pipe.decode_feed(stream, latent[:, :, 2:])
    fresh = pipe.decode_feed(pipe.decode_stream(), latent[:, :, 2:])
    assert torch.equal(carried, whole[5:])
    assert not torch.equal(fresh[3:], carried[3:])

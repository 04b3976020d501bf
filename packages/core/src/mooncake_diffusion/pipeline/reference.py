"""The reference pipeline: the stage API that workers call, and a colocated run.

    pipe = ReferencePipeline(PipelineConfig())          # random weights from a seed
    params = GenerationParams(prompt="a red fox", negative_prompt="blurry", seed=7)

    # Encode worker (one prompt per call; cacheable by prompt, e.g.
    #   EmbeddingCache(settings, encoder_id=pipe.encoder_id, encoder_version="1")
    #   .get_or_compute(prompt, {}, lambda: pipe.encode(prompt)))
    emb = pipe.encode(params.prompt)                    # {"embeds": [1, L, D]}
    cond = pipe.condition(params)                       # {"prompt_embeds", "negative_embeds"}
    # Denoise worker
    latent = pipe.denoise(cond, params, resume=None,    # resume: a SamplerState
                          on_step=lambda k, state: ...) # after every step, k = steps done
    # Decode worker
    for frames in pipe.decode_chunks(latent, 3):        # uint8 [F_i, H, W, 3] as they come
        ...
    # Everything in one process, no connector
    frames = pipe.run_colocated(params)                 # uint8 [frames, H, W, 3]

Every call blocks and runs under ``runtime.deterministic(config.threads)``; the
same config and params give the same bytes in any process, whether the stages
run together or apart, whether denoise ran straight through or resumed from a
checkpointed ``SamplerState``, and whatever the decode chunking. It measures the
serving system, not image quality: the weights are random.

Preemption: ``should_stop(k)`` is asked at every step boundary (after ``k``
steps); when it answers True, ``denoise`` raises ``DenoisePreempted`` carrying
the state, which ``resume=`` continues later. ``on_step`` exceptions propagate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager

import torch

from mooncake_diffusion.pipeline.dit import DiT
from mooncake_diffusion.pipeline.params import GenerationParams, PipelineConfig
from mooncake_diffusion.pipeline.runtime import deterministic
from mooncake_diffusion.pipeline.sampler import SAMPLER_NAME, SamplerState, euler_step
from mooncake_diffusion.pipeline.text_encoder import TextEncoder
from mooncake_diffusion.pipeline.tokenizer import tokenize
from mooncake_diffusion.pipeline.vae import DecodeStream, VaeDecoder

__all__ = ["DenoisePreempted", "ReferencePipeline"]

OnStep = Callable[[int, SamplerState], None]


class DenoisePreempted(Exception):
    """``denoise`` stopped at a step boundary because ``should_stop`` asked it to;
    ``state`` is where it stands (pass it as ``resume=`` to continue)."""

    def __init__(self, state: SamplerState) -> None:
        super().__init__(f"denoise preempted after step {state.step} of {state.total_steps}")
        self.state = state


class ReferencePipeline:
    """Text encoder, DiT and causal VAE decoder of one ``PipelineConfig``.

    Builds all three models at construction (~0.1 s at the default sizes); a
    worker that runs one stage may build the whole pipeline and call just that
    stage. Calls are serialised by a lock (torch's thread settings are
    process-wide), so one instance may be shared by threads.
    """

    sampler = SAMPLER_NAME

    def __init__(self, config: PipelineConfig | None = None) -> None:
        self.config = config if config is not None else PipelineConfig()
        self.model_id = self.config.model_id()
        #: Names the text encoder's weights (for ``EmbeddingCache``): the same config
        #: hash, so another config never reads these embeddings.
        self.encoder_id = self.model_id + "/text"
        self._lock = threading.Lock()
        with self._ctx():
            self.text_encoder = TextEncoder(self.config)
            self.dit = DiT(self.config)
            self.vae = VaeDecoder(self.config)

    def _ctx(self) -> AbstractContextManager[None]:
        return deterministic(self.config.threads)

    # ------------------------------------------------------------------ encode
    def encode(self, prompt: str) -> dict[str, torch.Tensor]:
        """``{"embeds": float32 [1, text_len, text_dim]}`` of one prompt."""
        with self._lock, self._ctx():
            return {"embeds": self.text_encoder(tokenize(prompt, self.config.text_len))}

    def condition(self, params: GenerationParams) -> dict[str, torch.Tensor]:
        """What Denoise needs: ``prompt_embeds`` and (with CFG) ``negative_embeds``."""
        cond = {"prompt_embeds": self.encode(params.prompt)["embeds"]}
        if params.cfg:
            cond["negative_embeds"] = self.encode(params.negative_prompt)["embeds"]
        return cond

    # ------------------------------------------------------------------ denoise
    def initial_state(self, params: GenerationParams) -> SamplerState:
        """Step 0 of ``params``: noise from ``params.seed``."""
        return SamplerState.initial(
            params.latent_shape(self.config),
            seed=params.seed,
            steps=params.steps,
            shift=self.config.shift,
        )

    def check_state(self, state: SamplerState, params: GenerationParams) -> None:
        """Raise ``ValueError`` unless ``state`` is a state of ``params``' run."""
        want = self.initial_state(params)
        if tuple(state.latent.shape) != tuple(want.latent.shape):
            raise ValueError(f"state latent {tuple(state.latent.shape)} is not {want.latent.shape}")
        if not torch.equal(state.sigmas, want.sigmas):
            raise ValueError("state schedule differs from this request's (steps or shift)")

    def denoise(
        self,
        cond: Mapping[str, torch.Tensor],
        params: GenerationParams,
        *,
        resume: SamplerState | None = None,
        on_step: OnStep | None = None,
        should_stop: Callable[[int], bool] | None = None,
    ) -> torch.Tensor:
        """Run the sampler to the end and return the latent ``float32 [1, C, T, h, w]``.

        ``resume``: continue from a checkpointed state (validated against
        ``params``) instead of step 0. ``on_step(k, state)`` runs after each step
        (``k`` steps done; ``state`` owns its tensors). ``should_stop(k)``: see the
        module docstring (``DenoisePreempted``). Raises ``KeyError`` when ``cond``
        lacks an embedding the params need.
        """
        state = resume if resume is not None else self.initial_state(params)
        if resume is not None:
            self.check_state(resume, params)
        text = cond["prompt_embeds"]
        neg = cond["negative_embeds"] if params.cfg else None
        g = float(params.guidance)

        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            if neg is None:
                return self.dit(x, sigma, text)
            both = self.dit(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([text, neg]))
            v_c, v_u = both.chunk(2)
            return v_u + g * (v_c - v_u)

        while not state.done:
            if should_stop is not None and should_stop(state.step):
                raise DenoisePreempted(state)
            with self._lock, self._ctx():
                state = euler_step(state, velocity)
            if on_step is not None:
                on_step(state.step, state)
        return state.latent

    # ------------------------------------------------------------------ decode
    def decode_chunks(self, latent: torch.Tensor, num_chunks: int = 1) -> Iterator[torch.Tensor]:
        """Frames of ``latent`` in ``num_chunks`` temporal chunks (fewer if the latent has
        fewer frames), each ``uint8 [F_i, H, W, 3]``; the causal cache carries over."""
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        stream = self.vae.stream()
        for chunk in torch.tensor_split(latent, min(num_chunks, latent.shape[2]), dim=2):
            with self._lock, self._ctx():
                frames = stream.feed(chunk)
            yield frames

    def decode_stream(self) -> DecodeStream:
        """A ``vae.DecodeStream`` for chunks that arrive one by one (e.g. over the
        connector); call ``decode_feed(stream, chunk)`` for each."""
        return self.vae.stream()

    def decode_feed(self, stream: DecodeStream, chunk: torch.Tensor) -> torch.Tensor:
        """Decode one arriving latent chunk on ``stream`` (see ``decode_stream``)."""
        with self._lock, self._ctx():
            return stream.feed(chunk)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """All frames of ``latent`` at once: ``uint8 [F, H, W, 3]``."""
        return torch.cat(list(self.decode_chunks(latent, 1)))

    # ------------------------------------------------------------------ together
    def run_colocated(self, params: GenerationParams, *, num_chunks: int = 1) -> torch.Tensor:
        """Encode, denoise and decode ``params`` in this process: ``uint8 [F, H, W, 3]``."""
        latent = self.denoise(self.condition(params), params)
        return torch.cat(list(self.decode_chunks(latent, num_chunks)))

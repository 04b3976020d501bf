"""Flow-matching Euler sampler with classifier-free guidance, and its explicit state.

    state = SamplerState.initial(shape, seed=7, steps=8, shift=3.0)   # noise at sigma 1
    while not state.done:
        state = euler_step(state, velocity)     # velocity(x, sigma) -> v
    latent = state.latent

    tensors = state.to_tensors()                # {"latent", "step", "sigmas"}: a checkpoint
    state = SamplerState.from_tensors(tensors)  # resumes bitwise where it left off

The schedule is ``sigma_i = s*u / (1 + (s-1)*u)`` for ``u = 1 - i/steps`` (time
shift ``s``), from 1 (pure noise) to 0 (the sample); a step moves the latent by
``(sigma_{i+1} - sigma_i) * v``. The sampler is a deterministic ODE solver: the
state after step ``k`` is the latent, ``k`` and the schedule, nothing else, so a
run resumed from any step's state ends in the same bytes as one that never
stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from mooncake_diffusion.pipeline.runtime import seeded_generator

__all__ = ["SAMPLER_NAME", "SamplerState", "euler_step", "flow_sigmas"]

#: Names the sampler and its schedule in checkpoint keys; change it with the maths.
SAMPLER_NAME = "flow-euler-v1"


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """``[steps + 1]`` float32 noise levels from 1 to 0 (computed in float64, rounded once)."""
    u = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * u / (1.0 + (shift - 1.0) * u)).to(torch.float32)


@dataclass(frozen=True)
class SamplerState:
    """Where a denoise run stands: ``latent`` after ``step`` of ``len(sigmas) - 1`` steps.

    Immutable; ``latent`` is owned by the state (callers that keep it across a
    step should not write into it).
    """

    latent: torch.Tensor
    step: int
    sigmas: torch.Tensor

    @property
    def total_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @classmethod
    def initial(
        cls, shape: tuple[int, ...], *, seed: int, steps: int, shift: float
    ) -> SamplerState:
        """Gaussian noise of ``shape`` from ``seed`` (float32), at step 0."""
        noise = torch.randn(shape, generator=seeded_generator(seed), dtype=torch.float32)
        return cls(noise, 0, flow_sigmas(steps, shift))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The state as contiguous CPU tensors: ``latent`` (float32), ``step`` (int64 [1]),
        ``sigmas`` (float32 [steps + 1])."""
        return {
            "latent": self.latent.contiguous(),
            "step": torch.tensor([self.step], dtype=torch.int64),
            "sigmas": self.sigmas.contiguous(),
        }

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> SamplerState:
        """Inverse of ``to_tensors`` (copies nothing; ``ValueError`` on a malformed set)."""
        missing = {"latent", "step", "sigmas"} - set(tensors)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        step, sigmas = tensors["step"], tensors["sigmas"]
        if step.dtype != torch.int64 or step.numel() != 1:
            raise ValueError("sampler state 'step' must be one int64")
        if sigmas.dtype != torch.float32 or sigmas.dim() != 1 or sigmas.shape[0] < 2:
            raise ValueError("sampler state 'sigmas' must be float32 [steps + 1]")
        k = int(step.reshape(()).item())
        if not 0 <= k <= sigmas.shape[0] - 1:
            raise ValueError(f"sampler state step {k} is outside 0..{sigmas.shape[0] - 1}")
        if tensors["latent"].dtype != torch.float32:
            raise ValueError("sampler state 'latent' must be float32")
        return cls(tensors["latent"], k, sigmas)


Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def euler_step(state: SamplerState, velocity: Velocity) -> SamplerState:
    """One Euler step: ``velocity(latent, sigma [B])`` is the (guided) flow velocity."""
    if state.done:
        raise ValueError("the sampler is already at its last step")
    i = state.step
    sigma, nxt = state.sigmas[i], state.sigmas[i + 1]
    x = state.latent
    v = velocity(x, sigma.expand(x.shape[0]))
    return SamplerState(x + (nxt - sigma) * v, i + 1, state.sigmas)

"""Determinism and seeded weights: what every stage of the reference pipeline runs under.

    with deterministic(threads=1):        # a fixed intra-op thread count, deterministic
        out = model(x)                    # kernels, no autograd; restored on exit
    init_weights(module, seed=0)          # every parameter drawn from one seeded generator

Bitwise reproducibility across processes rests on three things: weights drawn
from a private ``torch.Generator`` in a fixed (sorted-name) order, one fixed
thread count (a reduction split across a different number of threads may round
differently), and computing every tensor of a request at the same shapes in
every process (batch 1 per prompt, one latent frame at a time in the decoder).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["deterministic", "init_weights", "seeded_generator"]


@contextlib.contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads, deterministic algorithms only and
    gradients off; the previous settings come back on exit. Not thread-safe (torch's
    settings are process-wide): one stage call at a time per process."""
    # the debug-mode form of torch.use_deterministic_algorithms(True): that call also
    # sets torch._inductor.config.deterministic, and importing it pulls in inductor
    # and dynamo (2 s of a worker's first item with bytecode cached, 8 s without, on
    # 2 cores); nothing here is compiled by inductor
    prev_threads = torch.get_num_threads()
    prev_mode = torch.get_deterministic_debug_mode()
    torch.set_num_threads(threads)
    torch.set_deterministic_debug_mode("error")
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_deterministic_debug_mode(prev_mode)
        torch.set_num_threads(prev_threads)


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (the same stream in every process)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def init_weights(module: nn.Module, seed: int, *, gain: float = 1.0) -> None:
    """Overwrite every parameter of ``module`` from ``seed``, by sorted parameter name:
    matrices and kernels ~ N(0, gain^2 / fan_in), vectors named ``*bias`` zero, other
    vectors (norm scales) one. Same seed, same module layout: same bytes."""
    g = seeded_generator(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=g) * (gain / math.sqrt(fan_in)))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)

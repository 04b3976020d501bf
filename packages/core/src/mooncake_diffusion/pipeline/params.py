"""What a request asks for and how big the reference model is: msgspec structs, no torch.

    params = GenerationParams(prompt="a red fox", negative_prompt="blurry", seed=7,
                              steps=8, guidance=4.0, frames=9, height=64, width=64)
    blob = encode_params(params)          # bytes for Submit.params / WorkItem.params
    params = decode_params(blob)          # validated; ParamsError names the bad field
    config = PipelineConfig()             # model sizes; config.model_id() names the weights

Both structs validate in ``__post_init__`` and raise ``ParamsError`` (a
``ValueError``), so a bad request fails before any tensor is made. Importing this
module does not import torch: an orchestrator can decode params without it.
"""

from __future__ import annotations

import hashlib

import msgspec

__all__ = [
    "MAX_FRAMES",
    "MAX_SIDE",
    "MAX_STEPS",
    "GenerationParams",
    "ParamsError",
    "PipelineConfig",
    "decode_params",
    "encode_params",
]

MAX_STEPS = 1000
MAX_FRAMES = 1 + 4 * 64
MAX_SIDE = 2048
MAX_PROMPT = 4096


class ParamsError(ValueError):
    """A request or model configuration that the reference pipeline cannot run."""


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Sizes of the reference model (random weights drawn from ``weights_seed``).

    The spatial VAE stride is 8 and the temporal stride 4 (a latent frame
    ``t > 0`` decodes to 4 frames, the first to 1, as in Wan's causal VAE); the
    DiT patch is 1 x ``patch`` x ``patch``. ``threads`` is the torch intra-op
    thread count every stage runs under: results are bitwise reproducible
    across processes for one value, not across values. ``shift`` is the flow
    schedule's time shift (1.0: a linear schedule).
    """

    weights_seed: int = 0
    text_len: int = 32
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4
    latent_channels: int = 4
    patch: int = 2
    dit_dim: int = 132
    dit_depth: int = 6
    dit_heads: int = 4
    vae_channels: int = 16
    shift: float = 3.0
    threads: int = 1

    def __post_init__(self) -> None:
        for name in (
            "text_len",
            "text_dim",
            "text_layers",
            "text_heads",
            "latent_channels",
            "patch",
            "dit_dim",
            "dit_depth",
            "dit_heads",
            "vae_channels",
            "threads",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParamsError(f"{name} must be an integer >= 1, got {v!r}")
        if self.text_len < 3:
            raise ParamsError("text_len must be >= 3 (BOS, EOS and at least one token)")
        if self.text_dim % self.text_heads or self.dit_dim % self.dit_heads:
            raise ParamsError("text_dim / dit_dim must be multiples of their head counts")
        if self.dit_dim % 6:
            raise ParamsError("dit_dim must be a multiple of 6 (3-axis sinusoidal positions)")
        if not self.shift > 0:
            raise ParamsError(f"shift must be > 0, got {self.shift}")

    def model_id(self) -> str:
        """``"mcd-reference@<12 hex>"``: names these weights and numerics. Every field
        is hashed, ``threads`` included (the bytes of a result depend on it)."""
        blob = msgspec.json.encode(self, order="sorted")
        return "mcd-reference@" + hashlib.sha256(blob).hexdigest()[:12]

    @property
    def spatial_stride(self) -> int:
        """Pixels per latent cell along H and W times the patch (the size granule)."""
        return 8 * self.patch


class GenerationParams(msgspec.Struct, frozen=True, kw_only=True):
    """One text-to-image (``frames == 1``) or text-to-video request.

    ``frames`` is ``1 + 4k`` (the causal VAE's temporal stride); ``height`` and
    ``width`` are pixels, multiples of 16 (VAE stride 8 x DiT patch 2).
    ``guidance`` <= 1 disables classifier-free guidance (one DiT forward per
    step instead of two, and no negative prompt is encoded).
    """

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    steps: int = 12
    guidance: float = 4.0
    frames: int = 1
    height: int = 64
    width: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or len(self.prompt) > MAX_PROMPT:
            raise ParamsError(f"prompt must be a string of at most {MAX_PROMPT} characters")
        if not isinstance(self.negative_prompt, str) or len(self.negative_prompt) > MAX_PROMPT:
            raise ParamsError(f"negative_prompt must be a string of at most {MAX_PROMPT}")
        if not 0 <= self.seed < 2**63:
            raise ParamsError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 1 <= self.steps <= MAX_STEPS:
            raise ParamsError(f"steps must be in 1..{MAX_STEPS}, got {self.steps}")
        if not (self.guidance == self.guidance and abs(self.guidance) < 1e6):
            raise ParamsError(f"guidance must be a finite number, got {self.guidance}")
        if not (1 <= self.frames <= MAX_FRAMES and (self.frames - 1) % 4 == 0):
            raise ParamsError(f"frames must be 1 + 4k and at most {MAX_FRAMES}, got {self.frames}")
        for side in ("height", "width"):
            v = getattr(self, side)
            if not (16 <= v <= MAX_SIDE and v % 16 == 0):
                raise ParamsError(f"{side} must be a multiple of 16 in 16..{MAX_SIDE}, got {v}")

    @property
    def cfg(self) -> bool:
        """Whether classifier-free guidance runs (two branches per step)."""
        return self.guidance > 1.0

    @property
    def is_video(self) -> bool:
        return self.frames > 1

    def latent_shape(self, config: PipelineConfig) -> tuple[int, int, int, int, int]:
        """``[B=1, C, T, H, W]`` of this request's latent under ``config``."""
        t = 1 + (self.frames - 1) // 4
        return (1, config.latent_channels, t, self.height // 8, self.width // 8)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GenerationParams)


def encode_params(params: GenerationParams) -> bytes:
    """msgpack bytes of ``params`` (a map, so fields may be added later)."""
    return _encoder.encode(params)


def decode_params(blob: bytes) -> GenerationParams:
    """Inverse of ``encode_params``; raises ``ParamsError`` on bytes that are not valid
    params (wrong types, out-of-range values, unknown layout)."""
    try:
        return _decoder.decode(blob)
    except msgspec.ValidationError as e:
        raise ParamsError(f"invalid generation params: {e}") from None
    except msgspec.DecodeError as e:
        raise ParamsError(f"not generation params: {e}") from None

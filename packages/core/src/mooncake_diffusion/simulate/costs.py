"""Stage service times and memory facts for the cluster simulator, each with its source.

Every number is listed with its public source (paper, blog, engine file at a
commit) in ``docs/sources.md`` of this repository; tags as there: M measured,
D derived, S stated, A assumed. Values are seconds on one GPU (batch 1) unless
said otherwise. Nothing here is fitted to a desired result; where a source gives
a range the midpoint is used. docs/sources.md has one section per topic:
stage times, LightX2V's RTX 4090 setting, memory, transfers, GPUs and prices.

    kind       encode                  denoise                        decode
    wan-720p   0.5 s (0.07-0.9, M)     40 x 26.0 s (1041.5 s / 40, D) 5.0 s (4-6, D)
    qwen-1024  0.2 s (0.05-0.3, M)     50 x 0.25 s (SGLang, D)        0.2 s (0.1-0.3, D)
    flux-1024  0.04 s (0.02-0.05, M)   28 x 0.20 s (0.15-0.24, D)     0.15 s (0.1-0.2, D)
    qwen-4090  0.40 s resident /       8 x 1.88 s resident /          0.26 s (SDXL VAE
               12.89 s offloaded (M)   8 x 2.90 s offloaded (M)       on a 4090, M)

Model loads (``LOAD_GBPS``): a GPU that must load weights it does not hold (a model
swap, or a stage change) loads them at 3.8 GB/s (D: fastsafetensors' measured vLLM
start of Llama-2-13B, 26 GB in 6.88 s on one A100, engine start included; standard
loaders take 1.6 GB/s: 16.04 s there, and ServerlessLLM's 84 s for LLaMA-2-70B's 130 GB).

Transfers between stages: 0.025 s per boundary (LightX2V, ~4 ms
serialisation + ~20 ms RDMA, M). Decode tiling when the VAE shares the DiT's
GPU and does not fit: x1.5 time (tiling costs 0-100% extra, M; midpoint),
tiled peak / 3.5 (tiling cuts memory 3-4x, M).

Memory (GB, docs/sources.md "Memory"): each kind carries its encoder weights, DiT
weights and untiled VAE-decode peak; ``GpuType.usable_gb`` is what a GPU offers them
(90 % of its memory: the rest is a stated reserve for activations and the
allocator, an assumption). ``placement_penalty`` decides, from those numbers
alone, what an engine does on a GPU that must hold a set of stages: nothing
(fits), tile the decode, or offload weights to host memory (the measured
offloaded stage times, where a source gives them).

GPU types (``GPUS``): memory and bandwidth from the vendors' sheets, and an
on-demand price per GPU-hour from one public price list (docs/sources.md). An
Encode or Decode stage on a different GPU type runs ``bandwidth ratio`` x
slower (both stages are memory-bound at batch 1: an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "FLUX_1024",
    "GPUS",
    "H100",
    "L40S",
    "LOAD_GBPS",
    "QWEN_1024",
    "QWEN_4090",
    "QWEN_4090_50",
    "RTX_4090",
    "TRANSFER_S",
    "WAN_720P",
    "GpuType",
    "Placement",
    "RequestKind",
    "placement_penalty",
]

#: Seconds per stage boundary in a disaggregated run (M: LightX2V on H100 + IB).
TRANSFER_S = 0.025

#: GB/s at which a GPU loads weights it does not hold (model swap or stage change; D).
LOAD_GBPS = 3.8

#: Share of a GPU's memory the stages' weights and decode peak may use (assumption).
USABLE_SHARE = 0.9
#: Tiled decode: peak memory divided by this, time multiplied by ``decode_tile_factor``.
TILE_MEMORY_DIVISOR = 3.5


@dataclass(frozen=True)
class GpuType:
    """A GPU model: ``memory_gb``, memory ``bandwidth_tbs`` (TB/s) and the on-demand
    ``price_per_hour`` (USD per GPU-hour) of docs/sources.md ("GPUs and prices")."""

    name: str
    memory_gb: float
    bandwidth_tbs: float
    price_per_hour: float

    @property
    def usable_gb(self) -> float:
        return self.memory_gb * USABLE_SHARE

    def slowdown_vs(self, other: GpuType) -> float:
        """Stage-time multiplier of a memory-bound stage moved from ``other`` to this GPU."""
        return other.bandwidth_tbs / self.bandwidth_tbs


# docs/sources.md "GPUs and prices": memory and bandwidth from the vendor datasheets (S),
# price from RunPod's public on-demand list (S, one snapshot; prices change).
H100 = GpuType("h100", 80.0, 3.35, 1.99)
L40S = GpuType("l40s", 48.0, 0.864, 0.79)
RTX_4090 = GpuType("rtx4090", 24.0, 1.008, 0.34)
GPUS = {g.name: g for g in (H100, L40S, RTX_4090)}


@dataclass(frozen=True)
class Placement:
    """What a GPU holding some stages pays: ``tile`` the decode, ``offload`` weights."""

    tile: bool = False
    offload: bool = False


def placement_penalty(
    kind: RequestKind, gpu: GpuType, encode: bool, denoise: bool, decode: bool
) -> Placement:
    """What an engine does on ``gpu`` holding the given stages of ``kind``: nothing if
    weights + decode peak fit in ``gpu.usable_gb``; else a tiled decode if that fits;
    else weights offloaded to host memory (``offload_*_s`` apply, and the decode is
    tiled when it shares the GPU with the DiT). A DiT alone on a GPU it does not fit
    is the measured "resident" figure of the source (block swap is in that number)."""
    parts = (encode, denoise, decode)
    if sum(parts) <= 1:
        return Placement()
    enc = kind.encoder_gb if encode else 0.0
    dit = kind.dit_gb if denoise else 0.0
    vae = kind.vae_peak_gb if decode else 0.0
    if enc + dit + vae <= gpu.usable_gb:
        return Placement()
    if decode and enc + dit + vae / TILE_MEMORY_DIVISOR <= gpu.usable_gb:
        return Placement(tile=True)
    return Placement(tile=decode and denoise, offload=True)


@dataclass(frozen=True)
class RequestKind:
    """One kind of request and what each stage costs it on one GPU.

    ``encode_s`` covers every prompt the request encodes (positive and, with CFG,
    negative); ``negative_share`` is the part of it spent on the negative prompt
    (what a cluster-wide embedding cache saves once that prompt is cached).
    ``step_s`` is one denoise step, CFG included. ``decode_tile_factor`` multiplies
    decode time when the VAE must run tiled on the DiT's GPU (colocated, or
    disaggregated with the decode-memory mechanism off). ``decode_chunks``: the
    decode streams that many temporal chunks; time to first frame counts the
    first. ``offload_encode_s`` / ``offload_step_s``: the same stages with weights
    offloaded to host memory (small-memory GPUs), or None where not measured.
    ``encoder_gb`` / ``dit_gb`` / ``vae_peak_gb``: resident weights and the untiled
    decode's peak (``placement_penalty``).
    ``slo_s``: the deadline from submit, goodput counts completions within it.
    """

    name: str
    slo_class: str
    encode_s: float
    steps: int
    step_s: float
    decode_s: float
    negative_share: float = 0.5
    decode_tile_factor: float = 1.0
    decode_chunks: int = 1
    offload_encode_s: float | None = None
    offload_step_s: float | None = None
    slo_s: float = 60.0
    encoder_gb: float = 0.0
    dit_gb: float = 0.0
    vae_peak_gb: float = 0.0

    @property
    def denoise_s(self) -> float:
        return self.steps * self.step_s

    @property
    def isolated_s(self) -> float:
        """End-to-end seconds alone on one GPU, nothing cached or tiled."""
        return self.encode_s + self.denoise_s + self.decode_s

    def with_slo(self, scale: float) -> RequestKind:
        """A copy whose deadline is ``scale`` x its isolated latency."""
        return replace(self, slo_s=scale * self.isolated_s)


# Wan2.2-A14B T2V, 1280x720, 81 frames, 40 steps, CFG, one H100: 1041.5 s / 40 steps
# (D from the Wan2.2 comp_effic table); umT5 0.07-0.9 s (M); VAE
# 720p decode 4-6 s on H100 (D from FastVAE's A800 9.26 s M); 21 latent frames,
# decoded in 4 temporal chunks (the causal VAE streams, DESIGN). Tiled in a
# colocated GPU (memory in the module docstring).
WAN_720P = RequestKind(
    name="wan-720p",
    slo_class="batch",
    encode_s=0.5,
    steps=40,
    step_s=26.0,
    decode_s=5.0,
    decode_tile_factor=1.5,
    decode_chunks=4,
    encoder_gb=11.4,  # umT5-XXL bf16 (M)
    dit_gb=56.0,  # two 28 GB experts resident (D)
    vae_peak_gb=11.8,  # 720p 81 f decode peak (M on A800)
).with_slo(2.0)

# Qwen-Image 1024^2, 50 steps, true CFG: ~0.25 s/step on H100 (SGLang; D);
# Qwen2.5-VL encode 35-300 ms (M); VAE 0.1-0.3 s (D).
QWEN_1024 = RequestKind(
    name="qwen-1024",
    slo_class="interactive",
    encode_s=0.2,
    steps=50,
    step_s=0.25,
    decode_s=0.2,
    encoder_gb=16.6,  # Qwen2.5-VL-7B (S)
    dit_gb=40.9,  # docs/sources.md
    vae_peak_gb=8.5,  # 1024^2 decode peak: the SDXL VAE's measured 35.5 % of 24 GB (M)
).with_slo(3.0)

# FLUX.1-dev 1024^2, 28 steps, guidance-distilled (no CFG, one prompt): 0.15-0.24 s/step
# (compiled / eager); T5-XXL + CLIP 21-52 ms (M); VAE 0.1-0.2 s (D).
FLUX_1024 = RequestKind(
    name="flux-1024",
    slo_class="interactive",
    encode_s=0.04,
    steps=28,
    step_s=0.20,
    decode_s=0.15,
    negative_share=0.0,
    encoder_gb=9.8,  # T5-XXL + CLIP-L (M: file sizes)
    dit_gb=23.8,  # docs/sources.md
    vae_peak_gb=8.5,  # as Qwen-Image: 1024^2 (M for the SDXL VAE)
).with_slo(3.0)

# LightX2V's 8 x RTX 4090 Qwen-Image-2512 T2I (M: LightX2V blog): text encoder
# 12.89 s offloaded / 0.40 s resident; DiT step 2.90 s offloaded / 1.88 s alone on its
# GPU at 8 steps, 5.75 / 3.76 s at 50 steps. The blog does not state the step count of
# its QPS runs, so the simulator sweeps both (QWEN_4090 and QWEN_4090_50). VAE: the
# SDXL VAE at 1024^2 on a 4090 takes 0.256 s (M), used as the 4090 decode time.
QWEN_4090 = RequestKind(
    name="qwen-4090",
    slo_class="interactive",
    encode_s=0.40,
    steps=8,
    step_s=1.88,
    decode_s=0.26,
    offload_encode_s=12.89,
    offload_step_s=2.90,
    slo_s=60.0,
    encoder_gb=16.6,
    dit_gb=40.9,
    vae_peak_gb=8.5,
)
QWEN_4090_50 = replace(QWEN_4090, name="qwen-4090-50", steps=50, step_s=3.76, offload_step_s=5.75)

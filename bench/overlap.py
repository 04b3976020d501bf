"""Overlap benchmark: chunked latent handoff with decode running while later chunks move.

Run ``uv run python bench/overlap.py [--quick] [--json PATH] [--decode sleep|conv]
[--decode-ratio R | --decode-ms-per-frame MS] [--publish-workers N] [--repeats N]
[--latents wan720p,long] [--paths p2p,same_host,store] [--chunks 1,2,4,8,16]``.
One run starts a
``LocalCluster`` (a real ``mooncake_master`` plus a store host process, its pool prefaulted
as a long-running store host's is: ``store_host --prefault``) and a peer process
(this file with ``--peer``) that holds the producer connectors and the source latents.
This process is the consumer: it consumes each payload into a registered destination
and "decodes" it chunk by chunk as chunks land.

Latents (bf16, chunked along T, dim 2, the way ``torch.tensor_split`` cuts):

    wan720p  [1, 16, 21, 90, 160]   9.7 MB, Wan 2.x 720p, 81 frames
    long     [1, 16, 126, 90, 160]  58 MB, a video six times longer

Each is handed off whole (1 chunk, ``chunk_dim=None``: the whole-tensor handoff) and
chunked 2, 4, 8 and 16 ways, over three paths:

    p2p        p2p producer in the peer; the consumer has ``same_host=False``, so the
               producer writes each chunk with Transfer Engine over loopback TCP.
    same_host  the same producer; the consumer has the default settings, so the producer
               copies each chunk into this process with ``process_vm_writev``.
    store      store-mode producer in the peer (``--publish-workers``, default 4 like the
               connector's: up to 4 chunks are put into the store host at once); the
               consumer gets them and removes them (delete-on-consume).

What is timed. Every time is CLOCK_MONOTONIC (system-wide on Linux, so the two processes
share it). ``t0`` is read in the peer right before ``publish()`` of a latent whose bytes
are all ready (not a streaming publish); the peer prints the handle (hex, one JSON line)
at once, without ``wait()``, and this process calls ``consume(handle, dst=dst)`` as soon as
the line arrives. So every time below includes the publish call, the handle's trip to the
consumer and the consume call, as a real handoff through a queue would.

    TTFF         t0 -> the decode of chunk 0 returned (for 1 chunk: the whole latent
                 transferred and decoded).
    end-to-end   t0 -> the decode of the last chunk returned.
    transfer     t0 -> the last chunk landed, in a run of its own with no decode
                 (this chunking, same path); for 1 chunk, when ``consume`` returns (for
                 store that is after the delete-on-consume remove, as a caller sees it).
    decode       the sum of the measured per-chunk decode times of the end-to-end run.
    unchunked    end-to-end of the same latent and path sent whole (the 1-chunk row).
    overlap eff  max(whole transfer, whole decode) / end-to-end, both wholes from the
                 1-chunk row: 1.0 is perfect overlap; with equal transfer and decode
                 and n chunks an ideal pipeline gives n / (n + 1). Chunking that makes
                 the transfer or the decode slower cannot raise it (the numerator does
                 not see the chunked run); only a shorter end-to-end can.
                 Transfer and end-to-end come from different runs, so run-to-run noise
                 can push it a little above 1.
    TTFF ratio   TTFF with n chunks / TTFF of the whole-tensor handoff (same path, size).
    eff bound    the highest overlap efficiency this row's own measured parts allow:
                 max(whole transfer, whole decode) / max(chunk 0 landed + decode,
                 transfer + decode / n), with this row's chunk 0 landing time and
                 transfer from its transfer-only runs and its decode (the summed
                 per-chunk decodes) from its end-to-end runs. No pipeline can end
                 before chunk 0 landed and every chunk was decoded, nor before the
                 last chunk landed and was decoded. So efficiency / bound is what
                 the overlap itself achieves; the bound is what the path's first
                 chunk, its per-chunk costs and the decoder's per-chunk overhead
                 leave. For 1 chunk it is max(T, D) / (T + D): nothing overlaps. Its
                 parts are medians of different runs, so noise can put a run above it.

Decode model (``--decode``). ``sleep`` (the default): each chunk's decode is
``time.sleep(frames * ms_per_frame)``, proportional to the chunk's T slices. This is how a
GPU VAE decode looks to the host: the CPU thread launches kernels and waits, and the CPU
stays free for the transfer's own threads. A CPU busy-wait or a CPU convolution instead
takes one of this machine's two cores away from the Transfer Engine / store /
process_vm_writev threads, which a GPU decode does not do, so it mostly measures CPU
contention. ``conv`` runs a real decoder on the CPU, for comparison: each chunk's frames
are cast to float32 and go through 3x3 conv(16 -> w) -> SiLU -> 3x3 conv(w -> 3), frame by
frame (Conv3d with (1, 3, 3) kernels, so decoding chunk by chunk computes what decoding the
whole latent does), on one torch thread, with the width ``w`` (a power of two) whose
whole-latent time is nearest the target below. A CPU conv is not linear in the chunk size
(small chunks stay in cache: on this VM 8 chunks decode about twice as fast as the whole),
and it competes with the transfer for the CPU; read its rows as an illustration.

Calibration: the target decode time of the whole Wan-720p latent is the median
whole-tensor transfer time (7 runs) of the slowest path (of ``--paths``), measured first, times
``--decode-ratio`` (default 1.0: decode as long as the slowest transfer, the hardest case
for overlap); per frame that is target / 21, used for both latents
(``--decode-ms-per-frame`` fixes it instead). Real VAE decodes take far longer than these
transfers; the more decode outweighs transfer, the closer overlap efficiency gets to 1
and the TTFF ratio to 1 / chunks.

Every (latent, path, chunking) gets one warm-up run of each kind, whose bytes are checked
against the source (the destination zeroed first), so a wrong path cannot win; every run
checks ``ReceivedPayload.path`` (p2p/net, p2p/shm, store). The timed runs go round-robin
over the paths (the order flipped each repeat), a transfer-only run then an end-to-end run
each; the table shows medians. Store keys left behind are reported (there should be none).
The JSON rows also hold every run's times and ``chunk_landed_ms`` (t0 -> chunk i landed,
median by i over the transfer-only runs), which shows that chunks arrive one by one on
every path (store: the producer puts the chunks of a whole-latent publish in order and
tells the consumer each commit on its side channel; the consumer reads chunk i while chunk
i+1 is put, see ``docs/performance.md``). The ``*_range`` fields give each ratio's
[min, max] over the timed runs; ``--quick`` runs every configuration of the full run with
3 repeats instead of 7.
Handles travel between processes as bytes (hex in JSON lines over the peer's stdin and
stdout); nothing is pickled. On a 2-vCPU VM with a 250 Hz kernel a thread that loses its
CPU waits up to a 4 ms tick: expect outliers of that size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from _common import PeerClient, connector, serve_peer

from mooncake_diffusion import DiffusionConnector, LocalCluster, MooncakeSettings, StagePayload
from mooncake_diffusion.handoff.demo import make_tensor

DTYPE = "bfloat16"
CHUNK_DIM = 2  # T of [B, C, T, H, W]
LATENTS = {
    "wan720p": (1, 16, 21, 90, 160),
    "long": (1, 16, 126, 90, 160),
}
SEEDS = {"wan720p": 720, "long": 126}
CHUNKINGS = (1, 2, 4, 8, 16)
PATHS = ("p2p", "same_host", "store")
PRODUCER_MODE = {"p2p": "p2p", "same_host": "p2p", "store": "store"}
EXPECTED_PATH = {"p2p": "p2p/net", "same_host": "p2p/shm", "store": "store"}
TARGET_TTFF_RATIO = 0.3
TARGET_OVERLAP = 0.85


def log(msg: str) -> None:
    print(f"[overlap] {msg}", file=sys.stderr, flush=True)


def now() -> float:
    """Seconds on CLOCK_MONOTONIC: one clock for every process of this machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"verification failed: {what}")


def frames_of(x: torch.Tensor) -> int:
    return x.shape[CHUNK_DIM] if x.dim() > CHUNK_DIM else 1


# --------------------------------------------------------------------------- peer process
class Peer:
    """The producer side: one p2p and one store connector, and the source latents."""

    def __init__(self, settings: MooncakeSettings, publish_workers: int) -> None:
        self.conns = {
            "p2p": DiffusionConnector("denoise", "p2p", settings),
            "store": DiffusionConnector(
                "denoise", "store", settings, publish_workers=publish_workers
            ),
        }
        self.srcs: dict[str, torch.Tensor] = {}
        self.pubs: list[Any] = []

    def setup(self, name: str, shape: list[int], seed: int) -> dict[str, Any]:
        src = make_tensor(DTYPE, shape, seed)
        for conn in self.conns.values():
            conn.register(src)
        self.srcs[name] = src
        return {}

    def publish(self, mode: str, name: str, rid: str, chunks: int) -> dict[str, Any]:
        src = self.srcs[name]
        dim = CHUNK_DIM if chunks > 1 else None
        payload = StagePayload(rid, "latent", tensor=src, chunk_dim=dim, num_chunks=chunks)
        conn = self.conns[mode]
        t0 = now()
        pub = conn.publish(payload)  # returns at once; the bytes move on their own
        self.pubs.append(pub)
        return {"handle": pub.encode().hex(), "t0": t0}

    def release(self) -> dict[str, Any]:
        pubs, self.pubs = self.pubs, []
        for pub in pubs:
            pub.wait(30)  # surfaces a failed publish; done by now (the consumer has it all)
            pub.release()
        return {}

    def close(self) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            self.release()
        for conn in self.conns.values():
            conn.close()
        return {}


def peer_main(publish_workers: int) -> int:
    peer = Peer(MooncakeSettings.from_env(same_host=True), publish_workers)
    return serve_peer(
        {"setup": peer.setup, "publish": peer.publish, "release": peer.release, "close": peer.close}
    )


def start_peer(settings: MooncakeSettings, publish_workers: int) -> PeerClient:
    argv = [sys.executable, os.path.abspath(__file__), "--peer"]
    argv.append(f"--publish-workers={publish_workers}")
    return PeerClient(argv, env=dict(os.environ, **settings.as_env()))


# --------------------------------------------------------------------------- decoders
class SleepDecoder:
    """A GPU-like decode: the host thread waits ``frames * ms_per_frame``, CPU idle."""

    name = "sleep"

    def __init__(self, ms_per_frame: float) -> None:
        self.ms_per_frame = ms_per_frame

    def __call__(self, x: torch.Tensor) -> None:
        time.sleep(frames_of(x) * self.ms_per_frame / 1e3)

    def describe(self) -> dict[str, Any]:
        return {"model": self.name, "ms_per_frame": self.ms_per_frame}


class ConvDecoder:
    """A real (tiny) decoder on the CPU: 3x3 convolutions per frame, in float32.

    The chunk ``[1, 16, t, H, W]`` becomes ``t`` frames ``[16, H, W]``; then
    conv(16 -> width) -> SiLU -> conv(width -> 3), i.e. Conv3d with (1, 3, 3) kernels,
    so decoding chunk by chunk computes the same as decoding the whole latent.
    """

    name = "conv"

    def __init__(self, width: int) -> None:
        self.width = width
        gen = torch.Generator().manual_seed(0)
        self.w1 = torch.randn(width, 16, 3, 3, generator=gen) * 0.05
        self.w2 = torch.randn(3, width, 3, 3, generator=gen) * 0.05
        self.ms_per_frame = 0.0

    def __call__(self, x: torch.Tensor) -> None:
        with torch.inference_mode():
            f = x[0].transpose(0, 1).float()  # [1, 16, t, H, W] -> [t, 16, H, W]
            h = torch.nn.functional.silu(torch.nn.functional.conv2d(f, self.w1, padding=1))
            torch.nn.functional.conv2d(h, self.w2, padding=1)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "width": self.width,
            "ms_per_frame": self.ms_per_frame,
            "torch_threads": torch.get_num_threads(),
        }


Decoder = SleepDecoder | ConvDecoder


def time_decode(decoder: Decoder, x: torch.Tensor, runs: int = 3) -> float:
    """Median seconds of decoding all of ``x`` in one call."""
    decoder(x)
    times = []
    for _ in range(runs):
        t = now()
        decoder(x)
        times.append(now() - t)
    return statistics.median(times)


def conv_decoder_for(target_s: float, x: torch.Tensor) -> ConvDecoder:
    """The power-of-two width whose whole-``x`` decode time is closest to ``target_s``."""
    best: tuple[float, ConvDecoder] | None = None
    width = 1
    while width <= 256:
        dec = ConvDecoder(width)
        dt = time_decode(dec, x)
        dec.ms_per_frame = dt * 1e3 / frames_of(x)
        miss = abs(math.log(dt / target_s))
        if best is None or miss < best[0]:
            best = (miss, dec)
        if dt >= target_s:
            break
        width *= 2
    assert best is not None
    return best[1]


# --------------------------------------------------------------------------- one run
@dataclass
class Sample:
    handle_s: float  # t0 -> the handle line read here
    ttff_s: float  # t0 -> chunk 0 decoded (or landed, with no decoder)
    last_s: float  # t0 -> last chunk decoded (or landed)
    decode_s: float  # sum of per-chunk decode times
    landed_s: list[float]  # t0 -> chunk i handed to the loop, by i


class Bench:
    def __init__(
        self,
        peer: PeerClient,
        cons: dict[str, DiffusionConnector],
        dsts: dict[str, torch.Tensor],
        expected: dict[str, torch.Tensor],
    ) -> None:
        self.peer, self.cons, self.dsts, self.expected = peer, cons, dsts, expected
        self.count = 0

    def run(self, path: str, latent: str, chunks: int, decoder: Decoder | None) -> Sample:
        """Publish in the peer, consume here; decode each chunk as it lands if asked."""
        self.count += 1
        dst = self.dsts[latent]
        rid = f"ov-{latent}-{path}-{chunks}-{self.count}"
        mode = PRODUCER_MODE[path]
        reply = self.peer.call("publish", mode=mode, name=latent, rid=rid, chunks=chunks)
        t_handle = now()
        t0 = float(reply["t0"])
        got = self.cons[path].consume(bytes.fromhex(reply["handle"]), dst=dst)
        first_done = t_last = 0.0
        decode_s = 0.0
        landed: list[float] = []
        for chunk in got:
            t = now()
            landed.append(t - t0)
            if decoder is not None:
                decoder(chunk.tensor)
                t_dec = now()
                decode_s += t_dec - t
                t = t_dec
            if chunk.index == 0:
                first_done = t
            t_last = t
        got.release()
        self.peer.call("release")
        check(got.path == EXPECTED_PATH[path], f"{path} moved bytes via {got.path!r}")
        return Sample(t_handle - t0, first_done - t0, t_last - t0, decode_s, landed)

    def expected_tensor(self, latent: str) -> torch.Tensor:
        return self.expected[latent].view(torch.bfloat16).view(LATENTS[latent])

    def verify(self, path: str, latent: str, chunks: int, decoder: Decoder | None) -> None:
        dst = self.dsts[latent]
        dst.zero_()
        self.run(path, latent, chunks, decoder)
        same = torch.equal(dst.view(-1).view(torch.uint8), self.expected[latent])
        check(same, f"{path} {latent} {chunks} chunks: bytes differ from the source")


# --------------------------------------------------------------------------- measurement
@dataclass
class Row:
    latent: str
    shape: list[int]
    nbytes: int
    path: str
    chunks: int
    ttff_ms: float
    e2e_ms: float
    transfer_ms: float
    decode_ms: float
    overlap_efficiency: float
    ttff_ratio: float
    #: the highest overlap efficiency this row's measured parts allow (docstring)
    efficiency_bound: float
    #: [min, max] of the TTFF ratio and the overlap efficiency over the timed runs (each
    #: run against the 1-chunk row's medians): the spread a quick run is read with
    ttff_ratio_range: list[float]
    overlap_efficiency_range: list[float]
    #: end to end of the same latent and path sent whole (the 1-chunk row), ms
    unchunked_e2e_ms: float
    handle_ms: float
    #: t0 -> chunk i landed, median by i over the transfer-only runs
    chunk_landed_ms: list[float]
    #: every timed run, in run order (ms)
    runs_ms: dict[str, list[float]]


def med_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def measure_config(
    bench: Bench, cfg: Config, latent: str, chunks: int, decoder: Decoder
) -> dict[str, tuple[list[Sample], list[Sample]]]:
    """Verified warm-up, then (transfer-only, end-to-end) runs round-robin over paths."""
    paths, warmup, repeats = cfg.paths, cfg.warmup, cfg.repeats
    for path in paths:
        bench.verify(path, latent, chunks, None)
        bench.verify(path, latent, chunks, decoder)
        for _ in range(warmup - 1):
            bench.run(path, latent, chunks, None)
            bench.run(path, latent, chunks, decoder)
    out: dict[str, tuple[list[Sample], list[Sample]]] = {p: ([], []) for p in paths}
    for i in range(repeats):
        for path in paths if i % 2 == 0 else reversed(paths):
            out[path][0].append(bench.run(path, latent, chunks, None))
            out[path][1].append(bench.run(path, latent, chunks, decoder))
    return out


def make_row(latent: str, path: str, chunks: int, transfer: list[Sample], e2e: list[Sample]) -> Row:
    shape = LATENTS[latent]
    t_ms = med_ms([s.last_s for s in transfer])
    d_ms = med_ms([s.decode_s for s in e2e])
    e_ms = med_ms([s.last_s for s in e2e])
    return Row(
        latent=latent,
        shape=list(shape),
        nbytes=math.prod(shape) * 2,
        path=path,
        chunks=chunks,
        ttff_ms=med_ms([s.ttff_s for s in e2e]),
        e2e_ms=e_ms,
        transfer_ms=t_ms,
        decode_ms=d_ms,
        overlap_efficiency=float("nan"),  # filled in once the 1-chunk row is known
        ttff_ratio=float("nan"),
        efficiency_bound=float("nan"),
        ttff_ratio_range=[],
        overlap_efficiency_range=[],
        unchunked_e2e_ms=float("nan"),
        handle_ms=med_ms([s.handle_s for s in e2e]),
        chunk_landed_ms=[
            med_ms(list(ts)) for ts in zip(*(s.landed_s for s in transfer), strict=True)
        ],
        runs_ms={
            "ttff": [s.ttff_s * 1e3 for s in e2e],
            "e2e": [s.last_s * 1e3 for s in e2e],
            "transfer": [s.last_s * 1e3 for s in transfer],
            "decode": [s.decode_s * 1e3 for s in e2e],
        },
    )


def fill_ratios(rows: list[Row]) -> None:
    """TTFF ratio and overlap efficiency against the same latent and path sent whole.

    Overlap efficiency = max(whole transfer, whole decode) / end to end, where both
    wholes are the unchunked (1-chunk) row's: the floor a perfect overlap could reach.
    Chunking that slows the transfer or the decode down cannot raise it (only a shorter
    end to end can), and the unchunked end to end sits beside it in the table.
    """
    base = {(r.latent, r.path): r for r in rows if r.chunks == 1}
    for r in rows:
        b = base.get((r.latent, r.path))
        if b is None:
            continue
        r.ttff_ratio = r.ttff_ms / b.ttff_ms
        r.unchunked_e2e_ms = b.e2e_ms
        r.overlap_efficiency = max(b.transfer_ms, b.decode_ms) / r.e2e_ms
        # no run ends before chunk 0 landed and all was decoded, nor before the last
        # chunk landed and was decoded (1 chunk: chunk 0 is the whole, so T + D)
        floor_ms = max(r.chunk_landed_ms[0] + r.decode_ms, r.transfer_ms + r.decode_ms / r.chunks)
        r.efficiency_bound = max(b.transfer_ms, b.decode_ms) / floor_ms
        ratios = [t / b.ttff_ms for t in r.runs_ms["ttff"]]
        effs = [max(b.transfer_ms, b.decode_ms) / e for e in r.runs_ms["e2e"]]
        r.ttff_ratio_range = [round(min(ratios), 3), round(max(ratios), 3)]
        r.overlap_efficiency_range = [round(min(effs), 3), round(max(effs), 3)]


def calibrate(bench: Bench, cfg: Config, runs: int) -> tuple[Decoder, dict[str, float]]:
    """Whole-tensor transfer time of the Wan-720p latent per path -> the decoder."""
    latent = "wan720p"
    whole: dict[str, float] = {}
    for path in cfg.paths:
        bench.verify(path, latent, 1, None)
        bench.run(path, latent, 1, None)
        whole[path] = statistics.median(
            bench.run(path, latent, 1, None).last_s for _ in range(runs)
        )
    target = max(whole.values()) * cfg.decode_ratio
    frames = LATENTS[latent][CHUNK_DIM]
    if cfg.decode_ms_per_frame is not None:
        target = cfg.decode_ms_per_frame * frames / 1e3
    decoder: Decoder
    if cfg.decode == "conv":
        # One intra-op thread: the decode takes one core and leaves the other to the
        # transfer's threads; with two, every parallel region waits for a core that a
        # transfer thread holds (4 ms scheduler ticks on this VM).
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)  # random-byte latents hold denormals
        decoder = conv_decoder_for(target, bench.expected_tensor(latent))
    else:
        decoder = SleepDecoder(target * 1e3 / frames)
    return decoder, {p: s * 1e3 for p, s in whole.items()}


# --------------------------------------------------------------------------- report
def machine_info() -> dict[str, Any]:
    dists = importlib.metadata.packages_distributions().get("mooncake", [])
    versions = {d: importlib.metadata.version(d) for d in dists}
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mooncake": versions,
    }


def markdown(rows: list[Row]) -> str:
    lines = [
        "| latent | path | chunks | TTFF ms | end-to-end ms | unchunked end-to-end ms "
        "| transfer ms | decode ms | overlap eff (min-max) | eff bound | TTFF ratio (min-max) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        e_lo, e_hi = r.overlap_efficiency_range or [float("nan")] * 2
        t_lo, t_hi = r.ttff_ratio_range or [float("nan")] * 2
        lines.append(
            f"| {r.latent} | {r.path} | {r.chunks} | {r.ttff_ms:.2f} | {r.e2e_ms:.2f} "
            f"| {r.unchunked_e2e_ms:.2f} "
            f"| {r.transfer_ms:.2f} | {r.decode_ms:.2f} "
            f"| {r.overlap_efficiency:.3f} ({e_lo:.2f}-{e_hi:.2f}) | {r.efficiency_bound:.3f} "
            f"| {r.ttff_ratio:.3f} ({t_lo:.2f}-{t_hi:.2f}) |"
        )
    return "\n".join(lines)


def summary(rows: list[Row], decoder: Decoder, whole_ms: dict[str, float]) -> dict[str, Any]:
    at8 = [r for r in rows if r.chunks == 8]
    worst_ttff = max(at8, key=lambda r: r.ttff_ratio)
    worst_eff = min(at8, key=lambda r: r.overlap_efficiency)
    return {
        "ttff_ratio_8_chunks": worst_ttff.ttff_ratio,
        "ttff_ratio_8_chunks_worst_at": f"{worst_ttff.latent}/{worst_ttff.path}",
        "overlap_efficiency_8_chunks": worst_eff.overlap_efficiency,
        "overlap_efficiency_8_chunks_worst_at": f"{worst_eff.latent}/{worst_eff.path}",
        "ttff_target_max": TARGET_TTFF_RATIO,
        "overlap_target_min": TARGET_OVERLAP,
        "ttff_target_met": worst_ttff.ttff_ratio <= TARGET_TTFF_RATIO,
        "overlap_target_met": worst_eff.overlap_efficiency >= TARGET_OVERLAP,
        "ttff_ratio_8_chunks_range": worst_ttff.ttff_ratio_range,
        "overlap_efficiency_8_chunks_range": worst_eff.overlap_efficiency_range,
        "overlap_efficiency_8_chunks_bound": worst_eff.efficiency_bound,
        "at_8_chunks": {
            f"{r.latent}/{r.path}": {
                "ttff_ratio": r.ttff_ratio,
                "ttff_ratio_range": r.ttff_ratio_range,
                "overlap_efficiency": r.overlap_efficiency,
                "overlap_efficiency_range": r.overlap_efficiency_range,
                "efficiency_bound": r.efficiency_bound,
                "first_chunk_landed_ms": r.chunk_landed_ms[0],
            }
            for r in at8
        },
        "decoder": decoder.describe(),
        "calibration_whole_transfer_ms": whole_ms,
    }


# --------------------------------------------------------------------------- driver
@dataclass
class Config:
    latents: list[str]
    paths: list[str]
    chunkings: list[int]
    repeats: int
    warmup: int
    decode: str
    decode_ratio: float
    decode_ms_per_frame: float | None
    publish_workers: int
    quick: bool
    json_path: str | None


def run_all(cfg: Config, cluster: LocalCluster) -> tuple[list[Row], Decoder, dict[str, float]]:
    settings = cluster.settings
    assert settings is not None
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        peer = start_peer(settings, cfg.publish_workers)
        stack.callback(peer.close)
        names = sorted(set(cfg.latents) | {"wan720p"}, key=list(LATENTS).index)
        dsts = {n: torch.empty(LATENTS[n], dtype=torch.bfloat16) for n in names}
        expected = {
            n: make_tensor(DTYPE, LATENTS[n], SEEDS[n]).view(-1).view(torch.uint8) for n in names
        }
        for n in names:
            peer.call("setup", name=n, shape=list(LATENTS[n]), seed=SEEDS[n])
        regs = list(dsts.values())
        net = dataclasses.replace(settings, same_host=False)
        shm = dataclasses.replace(settings, same_host=True)
        cons = {
            "p2p": stack.enter_context(connector("decode", "p2p", net, *regs)),
            "same_host": stack.enter_context(connector("decode", "p2p", shm, *regs)),
            "store": stack.enter_context(connector("decode", "store", settings, *regs)),
        }
        bench = Bench(peer, cons, dsts, expected)
        decoder, whole_ms = calibrate(bench, cfg, runs=max(7, cfg.repeats))
        log(
            "whole-tensor transfer of wan720p (ms): "
            + ", ".join(f"{p} {v:.2f}" for p, v in whole_ms.items())
            + f"; decoder {decoder.describe()}"
        )
        for latent in cfg.latents:
            for chunks in cfg.chunkings:
                t = now()
                runs = measure_config(bench, cfg, latent, chunks, decoder)
                rows += [make_row(latent, p, chunks, *runs[p]) for p in cfg.paths]
                log(f"{latent} x{chunks}: done in {now() - t:.1f} s")
        log("closing connectors and the peer")
    fill_ratios(rows)
    rows.sort(key=lambda r: (cfg.latents.index(r.latent), PATHS.index(r.path), r.chunks))
    return rows, decoder, whole_ms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="3 repeats instead of 7 (same configurations)"
    )
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--repeats", type=int, help="timed runs per path, latent and chunking")
    p.add_argument("--latents", default=",".join(LATENTS), help="comma-separated latent names")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated paths")
    p.add_argument("--chunks", default=",".join(map(str, CHUNKINGS)), help="chunk counts")
    p.add_argument("--decode", choices=["sleep", "conv"], default="sleep", help="decode model")
    p.add_argument(
        "--decode-ratio",
        type=float,
        default=1.0,
        help="wan720p decode time / slowest whole-tensor transfer time (default 1.0)",
    )
    p.add_argument("--decode-ms-per-frame", type=float, help="fix the decode cost instead")
    p.add_argument(
        "--publish-workers",
        type=int,
        default=4,
        help="the store producer's publish_workers (the connector's default is 4)",
    )
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from(a: argparse.Namespace) -> Config:
    latents = [s.strip() for s in a.latents.split(",") if s.strip()]
    paths = [s.strip() for s in a.paths.split(",") if s.strip()]
    chunkings = sorted({int(s) for s in a.chunks.split(",") if s.strip()})
    if not latents or any(n not in LATENTS for n in latents):
        raise SystemExit(f"--latents takes names from {list(LATENTS)}")
    if not paths or any(p not in PATHS for p in paths):
        raise SystemExit(f"--paths takes names from {list(PATHS)}")
    if not chunkings or chunkings[0] < 1 or chunkings[-1] > 21:
        raise SystemExit("--chunks takes counts from 1 to 21")
    if 1 not in chunkings:
        chunkings.insert(0, 1)  # the whole-tensor handoff is every ratio's base
    if a.decode_ratio <= 0 or (a.decode_ms_per_frame is not None and a.decode_ms_per_frame <= 0):
        raise SystemExit("decode costs must be positive")
    return Config(
        latents=latents,
        paths=[p for p in PATHS if p in paths],
        chunkings=chunkings,
        repeats=a.repeats or (3 if a.quick else 7),
        warmup=1,
        decode=a.decode,
        decode_ratio=a.decode_ratio,
        decode_ms_per_frame=a.decode_ms_per_frame,
        publish_workers=a.publish_workers,
        quick=a.quick,
        json_path=a.json,
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.peer:
        return peer_main(a.publish_workers)
    cfg = config_from(a)
    t0 = time.perf_counter()
    log(f"starting LocalCluster; latents {cfg.latents}, chunks {cfg.chunkings}")
    with LocalCluster(pool_bytes=1 << 30, prefault=True) as cluster:
        rows, decoder, whole_ms = run_all(cfg, cluster)
        left = cluster.keys()
    if left:
        log(f"WARNING: {len(left)} store keys left behind: {left[:5]}")
    total = time.perf_counter() - t0
    summ = summary(rows, decoder, whole_ms) if any(r.chunks == 8 for r in rows) else {}
    print(markdown(rows))
    print(
        f"\ntotal {total:.1f} s; medians of {cfg.repeats} runs; decoder {decoder.describe()}; "
        f"ms = 1e-3 s"
    )
    if summ:
        print(
            f"8 chunks: worst TTFF ratio {summ['ttff_ratio_8_chunks']:.3f} "
            f"({summ['ttff_ratio_8_chunks_worst_at']}, target <= {TARGET_TTFF_RATIO}), "
            f"lowest overlap efficiency {summ['overlap_efficiency_8_chunks']:.3f} "
            f"({summ['overlap_efficiency_8_chunks_worst_at']}, target >= {TARGET_OVERLAP}; "
            f"its bound {summ['overlap_efficiency_8_chunks_bound']:.3f})"
        )
    if cfg.json_path:
        doc = {
            "bench": "overlap",
            "machine": machine_info(),
            "config": {k: v for k, v in asdict(cfg).items() if k != "json_path"},
            "latents": {n: {"shape": list(LATENTS[n]), "dtype": DTYPE} for n in cfg.latents},
            "units": {"*_ms": "median milliseconds", "overlap_efficiency": "ratio"},
            "rows": [asdict(r) for r in rows],
            "summary": summ,
            "markdown": markdown(rows),
            "store_keys_left": len(left),
            "total_seconds": total,
        }
        with open(cfg.json_path, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LightX2V bench: LightX2V's own transfer scheme vs the adapter, side by side, cross-process.

Run ``uv run python bench/lightx2v.py [--quick] [--json PATH] [--repeats N]``. One run
starts a ``LocalCluster`` (real ``mooncake_master`` + store host) and a peer process (this
file with ``--peer``) that plays the sending role; this process plays the receiving one:

    phase1   Encoder -> Transformer: Wan2.1 I2V 480p/81f encoder outputs (T5 context and
             context_null [1, 512, 4096], CLIP [257, 1280], VAE [20, 21, 60, 104], bf16:
             13.6 MiB of data; 27.3 MiB in LightX2V's fp32-sized buffers)
    phase2   Transformer -> Decoder: a Wan 720p/81f latent [16, 21, 90, 160] bf16 (9.2 MiB;
             18.5 MiB buffer)

Schemes, each timed from the sender starting its send call (the tensors exist) to the
receiver holding LightX2V's dict / latent tensor, checked:

    lightx2v           LightX2V's scheme at f8aee98b (lightx2v/disagg/conn.py, mooncake.py),
                       reimplemented here: the receiver's registered buffers are sized for fp32;
                       the sender copies each tensor into its own fp32-sized registered buffer,
                       writes a 4 KiB JSON meta with SHA-256 per tensor (of an fp32 copy for
                       bf16, as LightX2V's ``_sha256_tensor``), then sends every buffer whole in
                       1 MiB ``transfer_sync_write`` calls, one after another; the receiver clones
                       every buffer, parses the meta, rebuilds the tensors (``.clone()``) and
                       recomputes every SHA-256. Not modelled (in its favour): ZMQ pointer
                       exchange, the 10 ms status polling, re-arming the room.
    adapter_p2p        the adapter's six methods (``mooncake_diffusion_lightx2v.runner``) on a
                       runner-like object, ``transfer_mode: p2p``, same-host path off: Transfer
                       Engine over loopback TCP like the row above; latents in 4 chunks
    adapter_same_host  the same with the same-host path on (one memory copy; the default when
                       both roles share a host)
    adapter_store      ``transfer_mode: store``: sender puts into the store host, receiver gets
    adapter_p2p_crc32  adapter_p2p with ``verify: true`` (CRC-32 per tensor on both sides)
    lightx2v_nohash    LightX2V's scheme with the SHA-256 left out on both sides (no
                       integrity check, like adapter_p2p)

``sender ms`` runs until the send call returned. The adapter's sends return once the
payload is safe without the sender (p2p: once the receiver pulled it; store: once it is
in the store host), as LightX2V's own sends do, so the peer runs them on a thread and
the receiver starts meanwhile; a p2p sender's time therefore includes the receiver's
pull. LightX2V's scheme (reimplemented) returns once its writes are done.

Both processes run torch with one thread (see ``main``). The handle travels through the
Mailbox (Mooncake Store) in every adapter row, so its cost is in the numbers. Rows run
round-robin (order flipped every other repeat); medians.
``speedup`` = lightx2v seconds / row seconds of the same phase. The headline compares
like with like, on the same wire (Transfer Engine p2p): with an integrity check on
both sides (``*_speedup_with_integrity``: lightx2v with SHA-256 / adapter_p2p_crc32)
and without one on either side (``*_speedup_without_integrity``: lightx2v_nohash /
adapter_p2p).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from _common import PeerClient, serve_peer

from mooncake_diffusion import LocalCluster, MooncakeSettings

MIB = 1 << 20
LX_CHUNK = 1 << 20  # MOONCAKE_TRANSFER_CHUNK_BYTES
META_BYTES = 4096
IMAGE_TASKS = ("i2v", "flf2v", "animate", "s2v", "rs2v", "i2i")
GEOMETRY = {
    "phase1": {
        "target_height": 480,
        "target_width": 832,
        "payload": "Wan I2V 480p encoder outputs",
    },
    "phase2": {"target_height": 720, "target_width": 1280, "payload": "Wan 720p latent"},
}
ADAPTER = {
    "adapter_p2p": {"transfer_mode": "p2p", "same_host": False},
    "adapter_same_host": {"transfer_mode": "p2p", "same_host": True},
    "adapter_store": {"transfer_mode": "store"},
    "adapter_p2p_crc32": {"transfer_mode": "p2p", "same_host": False, "verify": True},
}
LX_SCHEMES = {"lightx2v": True, "lightx2v_nohash": False}  # name -> SHA-256 on both sides
SCHEMES = [*LX_SCHEMES, *ADAPTER]
INTEGRITY = {"lightx2v": "sha256", "adapter_p2p_crc32": "crc32"}
#: (LightX2V row, adapter row) compared in the headline, each pair like for like
HEADLINE = {
    "with_integrity": ("lightx2v", "adapter_p2p_crc32"),
    "without_integrity": ("lightx2v_nohash", "adapter_p2p"),
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def wan_config(phase: str) -> dict[str, Any]:
    g = GEOMETRY[phase]
    return {
        "model_cls": "wan2.1",
        "task": "i2v",
        "text_len": 512,
        "text_encoder_dim": 4096,
        "enable_cfg": True,
        "use_image_encoder": True,
        "clip_embed_dim": 329216,  # 257 x 1280, as LightX2V's I2V configs must set it
        "vae_z_dim": 16,
        "vae_stride": [4, 8, 8],
        "target_video_length": 81,
        "target_height": g["target_height"],
        "target_width": g["target_width"],
    }


def latent_dims(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    s = cfg["vae_stride"]
    t = 1 + (cfg["target_video_length"] - 1) // s[0]
    return (
        cfg["vae_z_dim"],
        t,
        math.ceil(cfg["target_height"] / s[1]),
        math.ceil(cfg["target_width"] / s[2]),
    )


def make_phase1(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """Deterministic encoder outputs in LightX2V's dict layout (same in both processes)."""
    g = torch.Generator().manual_seed(1)
    z, t, h, w = latent_dims(cfg)
    ctx = (1, cfg["text_len"], cfg["text_encoder_dim"])
    inputs = {
        "text_encoder_output": {
            "context": torch.randn(ctx, generator=g).to(torch.bfloat16),
            "context_null": torch.randn(ctx, generator=g).to(torch.bfloat16),
        },
        "image_encoder_output": {
            "clip_encoder_out": torch.randn((257, 1280), generator=g).to(torch.bfloat16),
            "vae_encoder_out": torch.randn((z + 4, t, h, w), generator=g).to(torch.bfloat16),
        },
    }
    return inputs, [z, t, h, w]


def make_phase2(cfg: dict[str, Any]) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(latent_dims(cfg), generator=g).to(torch.bfloat16)


def phase1_tensors(inputs: dict[str, Any]) -> list[torch.Tensor]:
    text, image = inputs["text_encoder_output"], inputs["image_encoder_output"]
    return [
        text["context"],
        text["context_null"],
        image["clip_encoder_out"],
        image["vae_encoder_out"],
    ]


# --------------------------------------------------------------------------- LightX2V's scheme
def lx_buffer_sizes(cfg: dict[str, Any], phase: str) -> list[int]:
    """LightX2V's fp32 upper-bound buffer sizes (``_estimate_encoder_buffer_sizes`` /
    ``estimate_transformer_buffer_sizes``, from their documented formulas)."""
    z, t, h, w = latent_dims(cfg)
    if phase == "phase2":
        return [z * t * h * w * 4, META_BYTES]
    ctx = cfg["text_len"] * cfg["text_encoder_dim"] * 4
    return [ctx, ctx, cfg["clip_embed_dim"] * 4, (z + 4) * t * h * w * 4, 10 * 8, META_BYTES]


def lx_sha256(t: torch.Tensor, hashed: bool = True) -> str:
    """LightX2V's per-tensor hash: bf16 goes through an fp32 copy first ("" unhashed)."""
    if not hashed:
        return ""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


def typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return buf[:n].view(dtype).view(shape)


def write_meta(buf: torch.Tensor, meta: dict[str, Any]) -> None:
    raw = json.dumps(meta).encode()
    buf.zero_()
    buf[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def read_meta(buf: torch.Tensor) -> dict[str, Any]:
    return json.loads(buf.numpy().tobytes().split(b"\x00", 1)[0])


class LxEndpoint:
    """One side of LightX2V's scheme: a Transfer Engine and fp32-sized registered buffers."""

    def __init__(self, settings: MooncakeSettings, sizes: list[int]) -> None:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        if self.te.initialize(settings.local_hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TE init failed")
        self.bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        for b in self.bufs:
            if self.te.register_memory(b.data_ptr(), b.numel(), "*") != 0:
                raise RuntimeError("TE register failed")
        self.session = f"{settings.local_hostname}:{self.te.get_rpc_port()}"

    def push(self, session: str, dst_ptrs: list[int]) -> None:
        """Every buffer whole, in 1 MiB synchronous writes, one after another."""
        for buf, dst in zip(self.bufs, dst_ptrs, strict=True):
            src, n = buf.data_ptr(), buf.numel()
            for off in range(0, n, LX_CHUNK):
                rc = self.te.transfer_sync_write(
                    session, src + off, dst + off, min(LX_CHUNK, n - off)
                )
                if rc != 0:
                    raise RuntimeError(f"transfer_sync_write failed ({rc})")

    def close(self) -> None:
        for b in self.bufs:
            self.te.unregister_memory(b.data_ptr())


def lx_send_phase1(
    ep: LxEndpoint, inputs: dict[str, Any], latent_shape: list[int], hashed: bool = True
) -> None:
    ctx, ctx_null, clip, vae = phase1_tensors(inputs)
    b = ep.bufs
    typed(b[0], torch.bfloat16, (ctx.numel(),)).copy_(ctx.reshape(-1))
    typed(b[1], torch.bfloat16, (ctx_null.numel(),)).copy_(ctx_null.reshape(-1))
    typed(b[2], torch.bfloat16, (clip.numel(),)).copy_(clip.reshape(-1))
    b[3].zero_()  # the padded VAE slot is zeroed, then filled
    typed(b[3], torch.bfloat16, (vae.numel(),)).copy_(vae.reshape(-1))
    shape_t = torch.tensor(latent_shape, dtype=torch.int64)
    b[4].zero_()
    typed(b[4], torch.int64, (len(latent_shape),)).copy_(shape_t)
    meta = {
        "version": 1,
        "task": "i2v",
        "context_shape": list(ctx.shape),
        "context_hash": lx_sha256(ctx, hashed),
        "context_null_shape": list(ctx_null.shape),
        "context_null_hash": lx_sha256(ctx_null, hashed),
        "clip_shape": list(clip.shape),
        "clip_hash": lx_sha256(clip, hashed),
        "vae_shape": list(vae.shape),
        "vae_hash": lx_sha256(vae, hashed),
        "latent_shape": latent_shape,
        "latent_hash": lx_sha256(shape_t, hashed),
    }
    write_meta(b[5], meta)


def lx_receive_phase1(ep: LxEndpoint, hashed: bool = True) -> dict[str, Any]:
    got = [b.clone() for b in ep.bufs]  # LightX2V snapshots every buffer first
    meta = read_meta(got[-1])
    ctx = typed(got[0], torch.bfloat16, tuple(meta["context_shape"])).clone()
    ctx_null = typed(got[1], torch.bfloat16, tuple(meta["context_null_shape"])).clone()
    clip = typed(got[2], torch.bfloat16, tuple(meta["clip_shape"])).clone()
    vae = typed(got[3], torch.bfloat16, tuple(meta["vae_shape"])).clone()
    shape = meta["latent_shape"]
    vae = vae[:, : shape[1], : shape[2], : shape[3]].clone()
    for t, key in ((ctx, "context"), (ctx_null, "context_null"), (clip, "clip"), (vae, "vae")):
        if lx_sha256(t, hashed) != meta[f"{key}_hash"]:
            raise ValueError(f"{key} hash mismatch")
    if lx_sha256(torch.tensor(shape, dtype=torch.int64), hashed) != meta["latent_hash"]:
        raise ValueError("latent_shape hash mismatch")
    return {
        "text_encoder_output": {"context": ctx, "context_null": ctx_null},
        "image_encoder_output": {"clip_encoder_out": clip, "vae_encoder_out": vae},
        "latent_shape": shape,
    }


def lx_send_phase2(ep: LxEndpoint, latents: torch.Tensor, hashed: bool = True) -> None:
    ep.bufs[0].zero_()
    typed(ep.bufs[0], latents.dtype, tuple(latents.shape)).copy_(latents)
    meta = {
        "version": 1,
        "latents_shape": list(latents.shape),
        "latents_dtype": str(latents.dtype),
        "latents_hash": lx_sha256(latents, hashed),
    }
    write_meta(ep.bufs[1], meta)


def lx_receive_phase2(ep: LxEndpoint, hashed: bool = True) -> torch.Tensor:
    got = [b.clone() for b in ep.bufs]
    meta = read_meta(got[1])
    latents = typed(got[0], torch.bfloat16, tuple(meta["latents_shape"]))
    if lx_sha256(latents, hashed) != meta["latents_hash"]:
        raise ValueError("latents hash mismatch")
    return latents.contiguous()


# --------------------------------------------------------------------------- the adapter
class BenchRunner:
    """What the adapter's methods need of a LightX2V runner: ``config`` (and
    ``input_info``), and ``set_config``, which ``init_disagg`` wraps so a request's
    settings end with it (``request_config.RoleConfig``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.input_info = None

    def set_config(self, config_modify: dict[str, Any]) -> None:
        """LightX2V's ``DefaultRunner.set_config`` at f8aee98b: the request's settings
        over the runner's config (its ``LockableDict`` unlocked for it; a dict here)."""
        self.config.update(config_modify)


def adapter_runner(settings: MooncakeSettings, scheme: str, phase: str, side: str) -> BenchRunner:
    from mooncake_diffusion_lightx2v import runner

    if phase == "phase1":
        mode = "encoder" if side == "send" else "transformer"
    else:
        mode = "transformer" if side == "send" else "decode"
    disagg = {
        "transfer_backend": "mooncake_diffusion",
        "master": settings.master,
        "admin": settings.admin_address,
        "channel": f"bench-{scheme}-{phase}",
        "receive_pool_mb": 64,
        **ADAPTER[scheme],
    }
    if mode == "transformer" and phase == "phase2":
        disagg["decoder_engine_rank"] = 2
    r = BenchRunner({**wan_config(phase), "disagg_mode": mode, "disagg_config": disagg})
    runner.init_disagg(r, r.config)
    return r


# --------------------------------------------------------------------------- peer (sender)
class Peer:
    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self.phase1 = make_phase1(wan_config("phase1"))
        self.latents = make_phase2(wan_config("phase2"))
        self.lx: dict[str, LxEndpoint] = {}
        self.runners: dict[tuple[str, str], BenchRunner] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="bench-send")
        self.sending: Future[float] | None = None

    def setup(self) -> dict[str, Any]:
        for phase in GEOMETRY:
            self.lx[phase] = LxEndpoint(self.settings, lx_buffer_sizes(wan_config(phase), phase))
            for scheme in ADAPTER:
                self.runners[scheme, phase] = adapter_runner(self.settings, scheme, phase, "send")
        return {}

    def send(
        self, scheme: str, phase: str, session: str = "", ptrs: list[int] | None = None
    ) -> dict:
        from mooncake_diffusion_lightx2v import runner

        t0 = time.perf_counter()
        if scheme in LX_SCHEMES:
            ep, hashed = self.lx[phase], LX_SCHEMES[scheme]
            if phase == "phase1":
                lx_send_phase1(ep, *self.phase1, hashed=hashed)
            else:
                lx_send_phase2(ep, self.latents, hashed=hashed)
            ep.push(session, ptrs or [])
            return {"t0": t0, "sent": time.perf_counter()}

        # The adapter's sends return once the payload is safe without the sender (p2p:
        # once the receiver pulled it), as LightX2V's own do: run on a thread, answered
        # at once, so the bench can receive; ``sent`` collects when it returned.
        def send() -> float:
            if phase == "phase1":
                runner.send_encoder_outputs(self.runners[scheme, phase], *self.phase1)
            else:
                runner.send_transformer_outputs(self.runners[scheme, phase], self.latents)
            return time.perf_counter()

        self.sending = self.pool.submit(send)
        return {"t0": t0}

    def sent(self) -> dict:
        """When the adapter send started by ``send`` returned (its error, if it failed)."""
        sending, self.sending = self.sending, None
        assert sending is not None, "no adapter send in flight"
        return {"sent": sending.result()}

    def close(self) -> dict:
        from mooncake_diffusion_lightx2v import runner

        if self.sending is not None:
            self.sending.cancel()
        self.pool.shutdown(wait=True)
        for r in self.runners.values():
            runner.release_disagg(r)
        for ep in self.lx.values():
            ep.close()
        return {}


# --------------------------------------------------------------------------- bench (receiver)
def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def run(
    settings: MooncakeSettings, repeats: int, warmup: int, schemes: list[str]
) -> list[dict[str, Any]]:
    from mooncake_diffusion_lightx2v import runner

    argv = [sys.executable, os.path.abspath(__file__), "--peer"]
    peer = PeerClient([*argv, f"--master={settings.master}", f"--admin={settings.admin_address}"])
    lx = {p: LxEndpoint(settings, lx_buffer_sizes(wan_config(p), p)) for p in GEOMETRY}
    runners = {(s, p): adapter_runner(settings, s, p, "receive") for s in ADAPTER for p in GEOMETRY}
    inputs, latent_shape = make_phase1(wan_config("phase1"))
    expected = {
        "phase1": {**inputs, "latent_shape": latent_shape},
        "phase2": make_phase2(wan_config("phase2")),
    }
    times: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    try:
        peer.call("setup")

        def once(scheme: str, phase: str) -> tuple[float, float, float, Any]:
            if scheme in LX_SCHEMES:
                ep, hashed = lx[phase], LX_SCHEMES[scheme]
                sent = peer.call(
                    "send",
                    scheme=scheme,
                    phase=phase,
                    session=ep.session,
                    ptrs=[b.data_ptr() for b in ep.bufs],
                )
                t1 = time.perf_counter()
                got = (
                    lx_receive_phase1(ep, hashed)
                    if phase == "phase1"
                    else lx_receive_phase2(ep, hashed)
                )
            else:
                sent = peer.call("send", scheme=scheme, phase=phase)
                t1 = time.perf_counter()
                r = runners[scheme, phase]
                got = (
                    runner.receive_encoder_outputs(r)
                    if phase == "phase1"
                    else runner.receive_transformer_outputs(r)
                )
                t_end = time.perf_counter()
                sent |= peer.call("sent")
                return t_end - sent["t0"], sent["sent"] - sent["t0"], t_end - t1, got
            t_end = time.perf_counter()
            return t_end - sent["t0"], sent["sent"] - sent["t0"], t_end - t1, got

        for phase in GEOMETRY:
            for scheme in schemes:
                for _ in range(warmup):
                    once(scheme, phase)
                *_, got = once(scheme, phase)
                if not same(got, expected[phase]):
                    raise RuntimeError(
                        f"{scheme} {phase}: received data differs from what was sent"
                    )
            log(f"{phase}: every scheme verified byte for byte")
            for i in range(repeats):
                order = schemes if i % 2 == 0 else schemes[::-1]
                for scheme in order:
                    times.setdefault((scheme, phase), []).append(once(scheme, phase)[:3])
    finally:
        peer.close()
        for r in runners.values():
            runner.release_disagg(r)
        for ep in lx.values():
            ep.close()
    rows = []
    for phase in GEOMETRY:
        base = statistics.median(t[0] for t in times["lightx2v", phase])
        cfg = wan_config(phase)
        real = (
            sum(t.numel() * 2 for t in phase1_tensors(inputs))
            if phase == "phase1"
            else expected["phase2"].numel() * 2
        )
        for scheme in schemes:
            ts = times[scheme, phase]
            med = statistics.median(t[0] for t in ts)
            rows.append(
                {
                    "phase": phase,
                    "payload": GEOMETRY[phase]["payload"],
                    "scheme": scheme,
                    "seconds": med,
                    "sender_s": statistics.median(t[1] for t in ts),
                    "receiver_s": statistics.median(t[2] for t in ts),
                    "wire_bytes": sum(lx_buffer_sizes(cfg, phase))
                    if scheme in LX_SCHEMES
                    else real,
                    "integrity": INTEGRITY.get(scheme, "none"),
                    "speedup": base / med,
                    "repeats": len(ts),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| phase | payload | scheme | integrity | wire MiB | end to end ms | sender ms "
        "| receiver ms | speedup vs lightx2v |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['payload']} | {r['scheme']} | {r['integrity']} "
            f"| {r['wire_bytes'] / MIB:.1f} | "
            f"{r['seconds'] * 1e3:.1f} | {r['sender_s'] * 1e3:.1f} | {r['receiver_s'] * 1e3:.1f} | "
            f"{r['speedup']:.2f} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline ratios like for like (``HEADLINE``), then every row against lightx2v."""
    out: dict[str, Any] = {"target_speedup": 3.0}
    sec = {(r["phase"], r["scheme"]): r["seconds"] for r in rows}
    for phase in GEOMETRY:
        for name, (lx, ours) in HEADLINE.items():
            if (phase, lx) in sec and (phase, ours) in sec:
                out[f"{phase}_speedup_{name}"] = round(sec[phase, lx] / sec[phase, ours], 2)
    for r in rows:
        if r["scheme"] not in LX_SCHEMES:
            out[f"{r['phase']}_speedup_{r['scheme'].removeprefix('adapter_')}"] = round(
                r["speedup"], 2
            )
    return out


def machine_info() -> dict[str, Any]:
    dists = importlib.metadata.packages_distributions().get("mooncake", [])
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mooncake": {d: importlib.metadata.version(d) for d in dists},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="3 repeats (under a minute)")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--repeats", type=int, help="timed runs per scheme and phase")
    p.add_argument(
        "--schemes",
        default=",".join(["lightx2v_nohash", *ADAPTER]),
        help="comma-separated rows to run besides lightx2v (always run: it is the base)",
    )
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--admin", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    # One torch thread in both processes: on a 2-vCPU machine torch's intra-op threads
    # (which spin after each parallel copy) steal the CPU from Mooncake's transfer
    # threads and make every row 2-3x slower and noisier. Both schemes get the same.
    torch.set_num_threads(1)
    if a.peer:
        peer = Peer(MooncakeSettings(master=a.master, admin=a.admin))
        return serve_peer(
            {"setup": peer.setup, "send": peer.send, "sent": peer.sent, "close": peer.close}
        )
    repeats = a.repeats or (3 if a.quick else 10)
    schemes = ["lightx2v", *[s for s in a.schemes.split(",") if s]]
    unknown = set(schemes) - set(SCHEMES)
    if unknown:
        raise SystemExit(f"unknown schemes {sorted(unknown)}; known: {SCHEMES}")
    t0 = time.perf_counter()
    log("starting LocalCluster (1 GiB pool) and the sending peer")
    with LocalCluster(pool_bytes=1 << 30) as cluster:
        rows = run(cluster.settings, repeats, 1 if a.quick else 2, schemes)
        left = cluster.keys()
    if left:
        log(f"WARNING: {len(left)} store keys left behind: {left[:5]}")
    total = time.perf_counter() - t0
    print(markdown(rows))
    print(f"\nsummary: {json.dumps(summary(rows))}")
    print(f"total {total:.1f} s; MiB = 2**20 B; medians of {repeats}")
    if a.json:
        doc = {
            "bench": "lightx2v",
            "machine": machine_info(),
            "config": {"repeats": repeats, "quick": a.quick, "schemes": schemes},
            "rows": rows,
            "summary": summary(rows),
            "markdown": markdown(rows),
            "store_keys_left": len(left),
            "total_seconds": total,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

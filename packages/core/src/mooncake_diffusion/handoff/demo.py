"""The transfer demo: a video-sized latent from a producer process to a consumer.

``run_handoff`` starts an embedded cluster (master + store host), a producer
process (``python -m mooncake_diffusion.handoff.demo producer``) and consumes in this
process, once per mode, printing what moved, how and how fast, and checking
every byte. The producer speaks JSON lines on stdin/stdout (handles as hex),
which is also how the integration tests drive a producer in another process:

    -> {"op": "publish", "mode": "p2p", "request_id": "r1", "dtype": "bfloat16",
        "shape": [1, 16, 21, 90, 160], "seed": 1, "lease": "delete_on_consume"}
    <- {"ok": true, "handle": "<hex>", "publish_s": 0.0004, "wait_s": 0.004}
    -> {"op": "stats"}   <- {"ok": true, "stats": {...}}
    -> {"op": "exit"}    (closes its connectors and exits 0)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any, TextIO

from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.platform.childproc import JsonLinesChild, serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import StagePayload

__all__ = ["ProducerProcess", "make_tensor", "run_handoff"]

#: Wan 2.x, 720p, 81 frames: the DiT's output latent [B, C, T, H, W] (workloads.md).
WAN_720P_LATENT = (1, 16, 21, 90, 160)


def make_tensor(dtype: str, shape: tuple[int, ...] | list[int], seed: int) -> Any:
    """Deterministic bytes for (dtype, shape, seed), identical in every process."""
    import torch

    t = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
    raw = t.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return t


# --------------------------------------------------------------------------- producer side
def _producer(settings: MooncakeSettings, stdin: TextIO, stdout: TextIO) -> int:
    conns: dict[str, DiffusionConnector] = {}
    keep: list[Any] = []  # p2p sources must outlive their publication

    def stats(cmd: dict) -> dict:
        return {"ok": True, "stats": {m: dataclasses.asdict(c.stats()) for m, c in conns.items()}}

    try:
        serve_json_lines(
            {"publish": lambda cmd: _publish(conns, keep, settings, cmd), "stats": stats},
            stdin,
            stdout,
        )
    finally:
        for c in conns.values():
            c.close()
    return 0


def _publish(
    conns: dict[str, DiffusionConnector], keep: list[Any], settings: MooncakeSettings, cmd: dict
) -> dict:
    mode = cmd["mode"]
    conn = conns.get(mode)
    if conn is None:
        conn = conns[mode] = DiffusionConnector("denoise", mode, settings)
    x = make_tensor(cmd["dtype"], cmd["shape"], cmd["seed"])
    conn.register(x)
    keep.append(x)
    payload = StagePayload(
        request_id=cmd["request_id"],
        kind=cmd.get("kind", "latent"),
        tensor=x,
        lease=cmd.get("lease", "delete_on_consume"),
        meta={"seed": cmd["seed"]},
        chunk_dim=cmd.get("chunk_dim"),
        num_chunks=cmd.get("num_chunks", 1),
        ttl_s=cmd.get("ttl_s"),
    )
    t0 = time.perf_counter()
    pub = conn.publish(payload)
    t1 = time.perf_counter()
    pub.wait(cmd.get("timeout", 60))
    t2 = time.perf_counter()
    return {"ok": True, "handle": pub.encode().hex(), "publish_s": t1 - t0, "wait_s": t2 - t1}


class ProducerProcess(JsonLinesChild):
    """A producer in a child process, driven over JSON lines (see module docstring)."""

    def __init__(self, settings: MooncakeSettings) -> None:
        argv = [sys.executable, "-m", "mooncake_diffusion.handoff.demo", "producer"]
        super().__init__(argv, settings, "producer")


# --------------------------------------------------------------------------- the demo
_PATHS = {
    "p2p": "p2p: producer writes into the consumer (same host: one memory copy)",
    "p2p-net": "p2p over the network: Transfer Engine batch write (loopback TCP here)",
    "store": "Mooncake Store: producer -> store host -> consumer",
}
MODES = tuple(_PATHS)


def run_handoff(
    shape: tuple[int, ...] = WAN_720P_LATENT,
    dtype: str = "bfloat16",
    modes: tuple[str, ...] = MODES,
    repeats: int = 3,
    out: TextIO = sys.stdout,
) -> list[dict]:
    """Run the demo and print its report; returns one row per mode."""
    import torch

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    nbytes = math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    say(f"latent: {list(shape)} {dtype} = {nbytes / 2**20:.1f} MiB (Wan 720p, 81 frames)")
    pool = max(1 << 30, 4 * nbytes)
    t0 = time.perf_counter()
    rows = []
    with LocalCluster(pool_bytes=pool) as cluster:
        assert cluster.settings is not None
        say(
            f"cluster up in {time.perf_counter() - t0:.1f}s: master {cluster.settings.master}, "
            f"store host with a {pool / 2**30:.1f} GiB pool"
        )
        net = dataclasses.replace(cluster.settings, same_host=False)
        with (
            ProducerProcess(cluster.settings) as producer,
            DiffusionConnector("decode", "auto", cluster.settings) as consumer,
            DiffusionConnector("decode", "p2p", net) as net_consumer,
        ):
            dst = torch.empty(shape, dtype=getattr(torch, dtype))
            consumer.register(dst)
            net_consumer.register(dst)
            for mode in modes:
                conn = net_consumer if mode == "p2p-net" else consumer
                rows.append(_handoff_mode(producer, conn, dst, mode, repeats, say))
            leftover = cluster.keys()
        say("")
        say(_table(rows, nbytes))
        say(
            f"store keys left: {len(leftover)}; every byte checked: "
            f"{'yes' if all(r['verified'] for r in rows) else 'NO'}"
        )
    return rows


def _handoff_mode(
    producer: ProducerProcess,
    consumer: DiffusionConnector,
    dst: Any,
    mode: str,
    repeats: int,
    say: Any,
) -> dict:
    import torch

    say(f"[{mode}] {_PATHS[mode]}")
    times, waits, verified = [], [], True
    for i in range(repeats):
        seed = 1000 + i
        r = producer.request(
            op="publish",
            mode=mode.removesuffix("-net"),
            request_id=f"demo-{mode}-{i}",
            dtype=str(dst.dtype)[6:],
            shape=list(dst.shape),
            seed=seed,
        )
        if not r["ok"]:
            raise MooncakeDiffusionError(f"producer failed: {r['error']}: {r['message']}")
        handle = bytes.fromhex(r["handle"])
        t = time.perf_counter()
        got = consumer.consume(handle, dst=dst)
        times.append(time.perf_counter() - t)
        waits.append(r["wait_s"])
        expected = make_tensor(str(dst.dtype)[6:], tuple(dst.shape), seed)
        ok = torch.equal(got.tensor.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))
        verified &= ok
        path = got.path
        got.release()
        say(
            f"  transfer {i + 1}/{repeats}: handle {len(handle)} B, producer wait "
            f"{r['wait_s'] * 1e3:.1f} ms, consume {times[-1] * 1e3:.1f} ms via {path}, "
            f"bytes equal: {ok}"
        )
    return {
        "mode": mode,
        "path": f"{path}: {_PATHS[mode]}",
        "consume_s": sorted(times)[len(times) // 2],
        "publish_wait_s": sorted(waits)[len(waits) // 2],
        "verified": verified,
    }


def _table(rows: list[dict], nbytes: int) -> str:
    lines = [
        "| mode | path | publish+wait (ms) | consume (ms) | end to end GB/s | bytes equal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = r["publish_wait_s"] + r["consume_s"]
        lines.append(
            f"| {r['mode']} | {r['path']} | {r['publish_wait_s'] * 1e3:.1f} | "
            f"{r['consume_s'] * 1e3:.1f} | {nbytes / total / 1e9:.2f} | {r['verified']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mooncake_diffusion.handoff.demo")
    p.add_argument("role", choices=["producer"])
    p.parse_args(argv)
    return _producer(MooncakeSettings.from_env(), sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

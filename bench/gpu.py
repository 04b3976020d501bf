"""GPU bench: device tensors through the connector against GPU memcpy, side by side.

Run ``uv run python bench/gpu.py [--quick] [--json PATH] [--sizes-mb 16,64,256]
[--repeats N]``. Needs a CUDA device; without one it measures nothing, prints
"not run: no CUDA device" and writes ``summary.cuda = false`` with the list of
measurements it would take, so a CPU run is never mistaken for a GPU result.

On a device, one run starts a ``LocalCluster`` (real ``mooncake_master`` and store
host) and, per size, times after one verified run and warm-up:

    memcpy_d2d       ``dst.copy_(src)`` device to device (CUDA events): the ceiling
    memcpy_d2h       device to pinned host: the staged path's own copy
    p2p_staged       connector p2p, CUDA tensor to CUDA destination, gpu_path=staged
                     (device -> pinned host -> Transfer Engine -> pinned host -> device)
    p2p_direct       the same with gpu_path=gpu-direct (the TE registers device memory);
                     only with a CUDA build of Mooncake, else reported as not run
    store_staged     connector store mode: publish + wait + consume, gpu_path=staged
    store_direct     the same, device memory registered with the store client

Both connectors live in this process with the same-host path off, so bytes cross
the Transfer Engine (loopback TCP unless an RDMA NIC is configured). ``ratio_d2h``
is a path's throughput over memcpy_d2h, ``ratio_d2d`` over memcpy_d2d; 1.0 would
mean the transfer costs no more than one copy on the device. Sizes are MiB,
throughput GB/s (1e9 bytes/s), times medians over repeats. ``--quick`` runs the
same configurations with fewer repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from typing import Any

from mooncake_diffusion.memory.device import nic_reaches_gpu
from mooncake_diffusion.platform.deployment import inspect_build, torch_cuda

MEMCPY = ("memcpy_d2d", "memcpy_d2h")
PATHS = ("p2p_staged", "p2p_direct", "store_staged", "store_direct")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        info["torch"] = None
    build = inspect_build()
    info["mooncake"] = (
        None
        if build is None
        else {"distribution": build.distribution, "version": build.version,
              "cuda_major": build.cuda_major}
    )  # fmt: skip
    return info


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def planned(sizes: list[int]) -> list[str]:
    return [f"{name} {mb} MiB" for mb in sizes for name in (*MEMCPY, *PATHS)]


def _time_copy(dst: Any, src: Any, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _time_connector(mode: str, gpu_path: str, cluster: Any, src: Any, repeats: int) -> float:
    import torch

    from mooncake_diffusion import DiffusionConnector, StagePayload

    settings = dataclasses.replace(cluster.settings, same_host=False, gpu_path=gpu_path)
    prod = DiffusionConnector("denoise", mode, settings)  # type: ignore[arg-type]
    cons = DiffusionConnector("decode", mode, settings)  # type: ignore[arg-type]
    dst = torch.empty_like(src)
    times = []
    try:
        for i in range(repeats + 2):  # run 0 is checked, run 1 warms up
            dst.zero_()
            t0 = time.perf_counter()
            pub = prod.publish(StagePayload(f"r{i}", "latent", tensor=src))
            cons.consume(pub.wait(120), dst=dst).release()
            elapsed = time.perf_counter() - t0
            if i == 0 and not torch.equal(dst, src):
                raise RuntimeError(f"{mode}/{gpu_path}: bytes differ after the transfer")
            if i >= 2:
                times.append(elapsed)
    finally:
        prod.close()
        cons.close()
    return statistics.median(times)


def run(sizes: list[int], repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch

    from mooncake_diffusion._mooncake.cluster import LocalCluster

    build = inspect_build()
    cuda_build = build is not None and build.device_memory
    rows: list[dict[str, Any]] = []
    with LocalCluster(pool_bytes=(max(sizes) << 20) * 4) as cluster:
        for mb in sizes:
            n = mb << 20
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
            d2d = _time_copy(torch.empty_like(src), src, repeats)
            pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            d2h = _time_copy(pinned, src, repeats)
            base = {"memcpy_d2d": d2d, "memcpy_d2h": d2h}
            for name, seconds in base.items():
                rows.append(
                    {"size_mb": mb, "path": name, "seconds": seconds, "gbps": n / seconds / 1e9}
                )
            for name in PATHS:
                mode, how = name.split("_")
                gpu_path = "staged" if how == "staged" else "gpu-direct"
                if gpu_path == "gpu-direct" and not cuda_build:
                    why = "the installed Mooncake is not a CUDA build"
                    rows.append({"size_mb": mb, "path": name, "not_run": why})
                    continue
                seconds = _time_connector(mode, gpu_path, cluster, src, repeats)
                gbps = n / seconds / 1e9
                rows.append({"size_mb": mb, "path": name, "seconds": seconds, "gbps": gbps,
                             "ratio_d2h": d2h / seconds, "ratio_d2d": d2d / seconds})  # fmt: skip
    summary = {
        "cuda": True,
        "gpu": torch.cuda.get_device_name(0),
        "mooncake_cuda_build": cuda_build,
        "nic_reaches_gpu": nic_reaches_gpu(cluster.settings.protocol),
        "ratios": {
            f"{r['path']} {r['size_mb']} MiB": {"vs_d2h": r["ratio_d2h"], "vs_d2d": r["ratio_d2d"]}
            for r in rows
            if "ratio_d2h" in r
        },
    }
    return rows, summary


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| MiB | path | GB/s | s | vs D2H | vs D2D |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "not_run" in r:
            lines.append(f"| {r['size_mb']} | {r['path']} | not run: {r['not_run']} | | | |")
            continue
        ratios = [f"{r[k]:.2f}" if k in r else "" for k in ("ratio_d2h", "ratio_d2d")]
        lines.append(
            f"| {r['size_mb']} | {r['path']} | {r['gbps']:.2f} | {r['seconds']:.4f} | "
            + " | ".join(ratios)
            + " |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        epilog="Without a CUDA device nothing is measured: the JSON summary has cuda: false "
        "and lists the measurements a GPU run takes.",
    )
    p.add_argument("--quick", action="store_true", help="same configurations, 3 repeats")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--sizes-mb", default="16,64,256", help="comma-separated MiB sizes")
    p.add_argument("--repeats", type=int, help="timed runs per path and size (default 10)")
    a = p.parse_args(argv)
    try:
        a.sizes = [int(s) for s in a.sizes_mb.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes-mb must be comma-separated integers, got {a.sizes_mb!r}")
    if not a.sizes or min(a.sizes) <= 0:
        p.error("--sizes-mb needs at least one positive size")
    if a.repeats is not None and a.repeats <= 0:
        p.error("--repeats must be positive")
    a.repeats = a.repeats or (3 if a.quick else 10)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if cuda_available():
        rows, summary = run(a.sizes, a.repeats)
        print(table(rows))
    else:
        rows = []
        summary = {
            "cuda": False,
            "status": "not run: no CUDA device",
            "torch_cuda": torch_cuda(),
            "would_measure": planned(a.sizes),
        }
        print("GPU bench not run: no CUDA device. It would measure:")
        print("\n".join(f"  {m}" for m in summary["would_measure"]))
    result = {"bench": "gpu", "machine": machine_info(), "rows": rows, "summary": summary}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

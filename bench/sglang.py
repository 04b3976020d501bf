"""SGLang bench: sglang's own Mooncake diffusion engine vs the adapter's engine, cross-process.

Run ``uv run python bench/sglang.py [--quick] [--json PATH] [--sizes-mb 16,64,256]
[--repeats N]`` from the repository root. sglang pins its own torch, so the script
re-launches itself in ``.venvs/sglang`` (built by ``./dev engines sglang``).

One run starts a receiver process (this file with ``--peer``) holding one landing
buffer, registered with both engines: sglang's ``MooncakeDiffusionEngine``
(``multimodal_gen/runtime/disaggregation/transport/engine.py``, sglang 0.5.23) and
the adapter's ``MooncakeDiffusionTransferEngine``. The buffer is what the adapter
gives sglang's ``TransferTensorBuffer`` (a shared memfd host pool); both engines
write into the very same bytes. This process is the sender, with one source buffer
registered with each engine, and times one ``transfer_sync`` per run (sglang's push):

    sglang_engine       sglang's own engine: Transfer Engine write, loopback TCP
                        (``MC_FORCE_TCP=1``: these machines have no RDMA NIC)
    sglang_engine_2     a second, identical sglang engine: the control. Its ratio is
                        the noise floor of the run (two identical paths differ by it)
    adapter_net         the adapter with ``same_host: off``: Transfer Engine write
                        through core (retries, checks, stats): the remote-style path
    adapter_same_host   the adapter with ``same_host: auto``: both ends on one host,
                        so it copies straight into the receiver's mapped pool

Paths run round-robin (the order flipped every repeat) after one verified run (the
receiver compares every byte with the pattern) and warm-up runs. ``ratio`` is the
throughput of an adapter path over ``sglang_engine`` at the same size; the summary's
``vs_sglang_engine_min`` is the smallest ``adapter_net`` ratio and
``vs_sglang_engine_same_host_min`` the smallest ``adapter_same_host`` ratio. Spread:
each repeat runs every path once, so each ratio is also taken per repeat (paired); rows
carry ``ratio_range`` and the summary's ``spread`` the [min, max] of those, with the
control's as the noise floor. ``--quick`` runs the same sizes and paths as the full run,
5 repeats instead of 20 (2 warm-ups each).
MiB = 2**20 B, GB/s = 1e9 B/s, medians. Nothing is pickled: the peer speaks JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# This file is named like the package it measures: keep its folder off the import
# path, or ``import sglang`` would find this script.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
ROOT = os.path.dirname(HERE)
VENV_PYTHON = os.path.join(ROOT, ".venvs", "sglang", "bin", "python")
MIB = 1 << 20
PATHS = ("sglang_engine", "sglang_engine_2", "adapter_net", "adapter_same_host")
BASE = "sglang_engine"


def _reexec() -> None:
    """Continue inside the engine environment when sglang is not importable here."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        return
    if not os.path.exists(VENV_PYTHON):
        sys.exit("bench/sglang.py needs .venvs/sglang: run `./dev engines sglang` once")
    os.execv(VENV_PYTHON, [VENV_PYTHON, os.path.abspath(__file__), *sys.argv[1:]])


def _light_sglang() -> None:
    """Make ``sglang`` importable without running ``sglang/__init__.py``.

    That file imports sglang's whole LLM runtime (30-45 s on this machine); the
    transfer modules measured here (``multimodal_gen.runtime.disaggregation.
    transport.engine`` and the srt Mooncake wrapper it uses) do not need it. The
    classes and everything they import are sglang's own, unchanged.
    """
    import importlib.util
    import types

    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations is not None
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["sglang"] = package


def _common() -> Any:
    """``bench/_common.py``, loaded by path (this folder is not on the import path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_common", os.path.join(HERE, "_common.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def make_pattern(nbytes: int) -> Any:
    import torch

    words = torch.arange(nbytes // 4, dtype=torch.int32).mul_(-1640531535)
    return words.view(torch.uint8)


# --------------------------------------------------------------------------- engines
def sglang_engine() -> Any:
    from sglang.multimodal_gen.runtime.disaggregation.transport.engine import (
        MooncakeDiffusionEngine,
    )

    return MooncakeDiffusionEngine(hostname="127.0.0.1")


def adapter_engine(same_host: str) -> Any:
    from mooncake_diffusion_sglang.engine import MooncakeDiffusionTransferEngine
    from mooncake_diffusion_sglang.options import Options

    return MooncakeDiffusionTransferEngine("127.0.0.1", options=Options(same_host=same_host))


# --------------------------------------------------------------------------- receiver
class Receiver:
    """One landing buffer (a shared host pool), registered with both engines."""

    def __init__(self, nbytes: int) -> None:
        from mooncake_diffusion.handoff.direct import allocate_pool

        self.pool = allocate_pool(nbytes)
        self.buf = self.pool.tensor
        self.engines = {"sglang": sglang_engine(), "adapter": adapter_engine("auto")}
        for e in self.engines.values():
            e.register_buffer(self.pool.base, nbytes)

    def setup(self) -> dict[str, Any]:
        sessions = {name: e.session_id for name, e in self.engines.items()}
        return {"sessions": sessions, "addr": self.pool.base}

    def check(self, n: int) -> dict[str, Any]:
        ok = bool(self.buf[:n].equal(make_pattern(n)))
        self.buf[:n].zero_()
        return {"equal": ok}

    def close(self) -> dict[str, Any]:
        from mooncake_diffusion.handoff.direct import release_pool

        for e in self.engines.values():
            e.deregister_buffer(self.pool.base)
        self.engines["adapter"].close()
        release_pool(self.pool.base)
        return {}


def peer_main(nbytes: int) -> int:
    recv = Receiver(nbytes)
    return _common().serve_peer({"setup": recv.setup, "check": recv.check, "close": recv.close})


# --------------------------------------------------------------------------- sender
@dataclass
class Row:
    size_bytes: int
    path: str
    seconds: float
    gbps: float
    ratio: float | None
    #: [min, max] over repeats of this path's throughput / sglang_engine's in the same
    #: repeat (paired: one stretch of noise); None for the base
    ratio_range: list[float] | None
    seconds_all: list[float]


class Sender:
    def __init__(self, nbytes: int, sessions: dict[str, str], addr: int) -> None:
        self.src = make_pattern(nbytes)
        ptr = self.src.data_ptr()
        self.engines = {
            "sglang_engine": sglang_engine(),
            "sglang_engine_2": sglang_engine(),
            "adapter_net": adapter_engine("off"),
            "adapter_same_host": adapter_engine("auto"),
        }
        for e in self.engines.values():
            e.register_buffer(ptr, nbytes)
        self.session = {
            "sglang_engine": sessions["sglang"],
            "sglang_engine_2": sessions["sglang"],
            "adapter_net": sessions["adapter"],
            "adapter_same_host": sessions["adapter"],
        }
        self.addr = addr

    def run(self, path: str, n: int) -> float:
        engine = self.engines[path]
        t = time.perf_counter()
        rc = engine.transfer_sync(self.session[path], self.src.data_ptr(), self.addr, n)
        dt = time.perf_counter() - t
        if rc != 0:
            raise RuntimeError(f"{path}: transfer_sync returned {rc}")
        return dt

    def paths_taken(self) -> dict[str, dict[str, int]]:
        return {p: self.engines[p].stats().by_path for p in PATHS if p.startswith("adapter")}

    def close(self) -> None:
        ptr = self.src.data_ptr()
        for name, e in self.engines.items():
            e.deregister_buffer(ptr)
            if name.startswith("adapter"):
                e.close()


def measure(sender: Sender, peer: Any, n: int, warmup: int, repeats: int) -> dict[str, list[float]]:
    for p in PATHS:
        sender.run(p, n)
        if not peer.call("check", n=n)["equal"]:
            raise RuntimeError(f"verification failed: {p} at {n} bytes")
        for _ in range(warmup):
            sender.run(p, n)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(repeats):
        for p in PATHS if i % 2 == 0 else reversed(PATHS):
            times[p].append(sender.run(p, n))
    return times


def rows_for(n: int, times: dict[str, list[float]]) -> list[Row]:
    medians = {p: statistics.median(ts) for p, ts in times.items()}
    gbps = {p: n / s / 1e9 for p, s in medians.items()}
    rows = []
    for p in PATHS:
        paired = [b / s for s, b in zip(times[p], times[BASE], strict=True)]
        spread = None if p == BASE else [round(min(paired), 3), round(max(paired), 3)]
        ratio = None if p == BASE else gbps[p] / gbps[BASE]
        rows.append(Row(n, p, medians[p], gbps[p], ratio, spread, times[p]))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| size | path | seconds (median) | GB/s | vs sglang_engine (per-repeat min-max) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "base"
        if r.ratio is not None and r.ratio_range is not None:
            ratio = f"{r.ratio:.2f} ({r.ratio_range[0]:.2f}-{r.ratio_range[1]:.2f})"
        lines.append(
            f"| {r.size_bytes / MIB:g} MiB | {r.path} | {r.seconds:.6f} | {r.gbps:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import importlib.metadata
    import platform

    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sglang": version("sglang"),
        "mooncake": version("mooncake-transfer-engine-non-cuda")
        or version("mooncake-transfer-engine"),
        "protocol": "tcp (MC_FORCE_TCP=1)",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="5 repeats instead of 20 (same sizes and paths)"
    )
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--sizes-mb", default="16,64,256", help="comma-separated MiB sizes")
    p.add_argument("--repeats", type=int, help="timed runs per path and size")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MC_FORCE_TCP", "1")  # sglang's engine defaults to RDMA
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.peer:
        _light_sglang()
        return peer_main(args.max_bytes)
    _reexec()
    _light_sglang()
    PeerClient = _common().PeerClient

    sizes = [int(float(s) * MIB) for s in args.sizes_mb.split(",")]
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = 2
    max_bytes = max(sizes)
    t0 = time.perf_counter()
    log("starting the receiver process and the engines")
    peer = PeerClient(
        [sys.executable, os.path.abspath(__file__), "--peer", f"--max-bytes={max_bytes}"]
    )
    sender = None
    try:
        target = peer.call("setup")
        sender = Sender(max_bytes, target["sessions"], int(target["addr"]))
        log(f"ready after {time.perf_counter() - t0:.1f} s")
        rows: list[Row] = []
        for n in sizes:
            t = time.perf_counter()
            rows += rows_for(n, measure(sender, peer, n, warmup, repeats))
            log(f"{n / MIB:g} MiB: done in {time.perf_counter() - t:.1f} s")
        taken = sender.paths_taken()
    finally:
        if sender is not None:
            sender.close()
        peer.close()

    def min_ratio(path: str) -> float:
        return min(r.ratio for r in rows if r.path == path and r.ratio is not None)

    def min_range(path: str) -> list[float]:
        """[min, max] over repeats of the smallest-over-sizes paired ratio."""
        series = [
            [b / s for s, b in zip(r.seconds_all, base.seconds_all, strict=True)]
            for r in rows
            if r.path == path
            for base in rows
            if base.path == BASE and base.size_bytes == r.size_bytes
        ]
        worst = [min(v) for v in zip(*series, strict=True)]
        return [round(min(worst), 3), round(max(worst), 3)]

    summary = {
        "vs_sglang_engine_min": min_ratio("adapter_net"),
        "vs_sglang_engine_same_host_min": min_ratio("adapter_same_host"),
        "spread": {
            "vs_sglang_engine_min": min_range("adapter_net"),
            "vs_sglang_engine_same_host_min": min_range("adapter_same_host"),
            "control_vs_sglang_engine_min": min_range("sglang_engine_2"),
        },
        "control_vs_sglang_engine": [
            round(r.ratio, 3) for r in rows if r.path == "sglang_engine_2" and r.ratio
        ],
        "targets": {"vs_sglang_engine_min": 0.95, "vs_sglang_engine_same_host_min": 3.0},
        "adapter_paths_taken": taken,
        "wall_s": time.perf_counter() - t0,
    }
    print(markdown(rows))
    print()
    print(
        f"vs_sglang_engine_min {summary['vs_sglang_engine_min']:.2f} (target >= 0.95), "
        f"vs_sglang_engine_same_host_min {summary['vs_sglang_engine_same_host_min']:.2f} "
        "(target >= 3.0); control (identical engine) "
        + ", ".join(f"{x:.2f}" for x in summary["control_vs_sglang_engine"])
    )
    if args.json:
        out = {
            "bench": "sglang",
            "machine": machine_info(),
            "config": {"sizes": sizes, "repeats": repeats, "warmup": warmup, "quick": args.quick},
            "rows": [asdict(r) for r in rows],
            "summary": summary,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

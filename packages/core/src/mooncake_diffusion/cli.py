"""The ``mooncake-diffusion`` command."""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import sys
import threading

from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.orchestrator.commands import add_commands

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512M"``, ``"4096"`` -> bytes; raises ``ArgumentTypeError``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 1GiB)")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (e.g. 1,16,21,90,160)") from None
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"shape dimensions must be positive: {text!r}")
    return shape


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    known = ("p2p", "p2p-net", "store")
    bad = sorted(set(modes) - set(known))
    if not modes or bad:
        raise argparse.ArgumentTypeError(
            f"unknown modes {bad or [text]}; choose from {', '.join(known)}"
        )
    return modes


def _cluster_up(args: argparse.Namespace) -> int:
    from mooncake_diffusion._mooncake.cluster import LocalCluster

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with LocalCluster(
        args.pool_size, host=args.host, lease_ttl_ms=args.lease_ttl_ms, prefault=args.prefault
    ) as c:
        s = c.settings
        assert s is not None
        print(
            f"Mooncake cluster up: master {s.master}, admin http://{s.admin_address}, "
            f"store host pool {args.pool_size / 2**30:.2f} GiB "
            f"({c.prefaulted_bytes / 2**30:.2f} GiB prefaulted)"
        )
        print("Connect with these settings (Ctrl-C stops the cluster):")
        for k, v in s.as_env().items():
            print(f"export {k}={v}")
        sys.stdout.flush()
        stop.wait()
        print("stopping cluster", flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mooncake_diffusion.demo import run_demo

    return run_demo(
        args.images,
        args.videos,
        args.steps,
        args.denoise_workers,
        args.out,
        not args.no_verify,
        serve=args.serve,
        encode_workers=args.encode_workers,
        planner=args.planner,
    )


def _handoff(args: argparse.Namespace) -> int:
    from mooncake_diffusion.handoff.demo import run_handoff

    rows = run_handoff(args.shape, args.dtype, args.modes, args.repeats)
    return 0 if all(r["verified"] for r in rows) else 1


def _store_ls(args: argparse.Namespace) -> int:
    import json

    from mooncake_diffusion.handoff.inventory import inventory, render, render_keys, summarise
    from mooncake_diffusion.platform.settings import MooncakeSettings

    over = {k: v for k, v in (("master", args.master), ("admin", args.admin)) if v}
    entries = inventory(MooncakeSettings.from_env(**over), ttl_s=args.ttl_s)
    if args.json:
        print(json.dumps([e.__dict__ for e in entries], indent=1))
    elif args.keys:
        print(render_keys(entries))
    else:
        print(render(summarise(entries)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mooncake-diffusion",
        description="Disaggregated diffusion serving on Mooncake: move stage outputs "
        "(embeddings, latents) between Encode, Denoise and Decode workers.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="the whole system: cluster, orchestrator, E/D/V workers, a mixed batch",
        description="Start a Mooncake master and store host, the orchestrator and Encode, "
        "Denoise and Decode worker processes running the tiny reference pipeline; submit "
        "interactive images and batch videos (sharing a negative prompt), show live "
        "progress, then a per-request table (TTFF, time in each queue and stage, bytes "
        "and paths, cache hits) and write the outputs (PNG, GIF) to a folder. Every "
        "output is checked bitwise against a colocated run. Random weights: it measures "
        "the serving system, not image quality.",
    )
    demo.add_argument("--images", type=int, default=4, help="interactive images (default 4)")
    demo.add_argument("--videos", type=int, default=6, help="batch videos, 17 frames (default 6)")
    demo.add_argument("--steps", type=int, default=8, help="denoise steps (default 8)")
    demo.add_argument(
        "--denoise-workers", type=int, default=1, help="denoise worker processes (default 1)"
    )
    demo.add_argument(
        "--encode-workers",
        type=int,
        default=2,
        help="encode worker processes (default 2: sized for images; the planner may move one)",
    )
    demo.add_argument(
        "--planner",
        default="reactive",
        help="the orchestrator's planner once the workers are warm (default reactive; "
        "static: the pools never change)",
    )
    demo.add_argument("--out", help="output folder (default: a new temporary folder)")
    demo.add_argument(
        "--no-verify", action="store_true", help="skip the bitwise check against colocated"
    )
    demo.add_argument(
        "--serve",
        action="store_true",
        help="after the report, keep the system up (live dashboard at /dashboard, API docs "
        "at /docs, OpenAI-style routes) and print its address, until Ctrl-C",
    )
    demo.set_defaults(func=_demo)

    handoff = sub.add_parser(
        "handoff",
        help="move a video-sized latent between two processes through p2p and store",
        description="Start an embedded Mooncake cluster and a producer process, move a "
        "Wan 720p video latent to this process through each path, check every byte "
        "and print what moved, how and how fast.",
    )
    handoff.add_argument(
        "--shape",
        type=_shape,
        default=(1, 16, 21, 90, 160),
        help="latent shape, comma separated (default: Wan 720p, 81 frames)",
    )
    handoff.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="latent dtype",
    )
    handoff.add_argument(
        "--modes",
        type=_modes,
        default=("p2p", "p2p-net", "store"),
        help="paths to show, comma separated: p2p (a same-host memory copy when possible), "
        "p2p-net (Transfer Engine only), store (default: all three)",
    )
    handoff.add_argument("--repeats", type=int, default=3, help="transfers per mode (default 3)")
    handoff.set_defaults(func=_handoff)

    cluster = sub.add_parser("cluster", help="run an embedded Mooncake cluster")
    csub = cluster.add_subparsers(dest="action", required=True)
    up = csub.add_parser(
        "up",
        help="start a master and a store host; print connection settings; stay up until Ctrl-C",
    )
    up.add_argument(
        "--pool-size", type=parse_size, default=1 << 30, help="store host DRAM pool (default 1GiB)"
    )
    up.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    up.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        help="leave the pool's pages to be faulted in by the first puts (default: fault them "
        "all in at start; over TCP, puts into never-used pages run about half as fast)",
    )
    up.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=1000,
        help="master's read-lease TTL in ms (default 1000)",
    )
    up.set_defaults(func=_cluster_up)

    store = sub.add_parser("store", help="inspect what a Mooncake store holds")
    ssub = store.add_subparsers(dest="action", required=True)
    ls = ssub.add_parser(
        "ls",
        help="list the store's keys by kind (payload, record, claimed, marker, cache, "
        "other) with their size and expiry",
        description="List what the store holds: by default a table by kind (keys, bytes, "
        "the soonest expiry); --keys one line per key. Keys carry their expiry, not their "
        "birth: pass --ttl-s (the ttl_s that wrote them) to see their age. The master "
        "comes from MOONCAKE_MASTER / MOONCAKE_ADMIN unless given.",
    )
    ls.add_argument("--master", help="the master's RPC address (default $MOONCAKE_MASTER)")
    ls.add_argument("--admin", help="the master's admin address (default $MOONCAKE_ADMIN)")
    ls.add_argument("--keys", action="store_true", help="one line per key")
    ls.add_argument("--json", action="store_true", help="every key as JSON")
    ls.add_argument("--ttl-s", type=float, help="the ttl_s the keys were written with (age)")
    ls.set_defaults(func=_store_ls)
    add_commands(sub)
    return p


#: Lines Mooncake prints on every healthy start-up; the CLI drops only these.
_NATIVE_NOISE = (
    b"Local segment descriptor not found",
    b"WARNING: Logging before InitGoogleLogging()",
)


def _filter_native_stderr() -> None:
    """Route fd 2 (shared with Mooncake's C++ logging and child processes) through
    a thread that drops the known start-up noise and passes everything else."""
    out = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump() -> None:
        with os.fdopen(r, "rb") as src:
            for line in src:
                if not any(n in line for n in _NATIVE_NOISE):
                    os.write(out, line)

    pumper = threading.Thread(target=pump, name="mcd-stderr", daemon=True)
    pumper.start()

    def drain() -> None:  # at exit: close our end so the pump sees EOF and finishes
        sys.stderr.flush()
        os.dup2(out, 2)
        pumper.join(timeout=2)

    atexit.register(drain)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("MC_LOG_LEVEL", "ERROR") == "ERROR":
        _filter_native_stderr()
    try:
        return args.func(args)
    except MooncakeDiffusionError as e:
        print(f"mooncake-diffusion: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"mooncake-diffusion: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

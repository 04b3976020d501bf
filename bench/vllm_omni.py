"""vLLM-Omni bench: MooncakeDiffusionConnector vs vLLM-Omni's own connectors, cross-process.

Run ``uv run python bench/vllm_omni.py [--quick] [--json PATH] [--sizes-mb 16,64,256]
[--repeats N]`` from the repository root. It re-launches itself inside the engine
environment ``.venvs/vllm_omni`` (the real vllm 0.30.0 + vllm-omni 0.30.0), which
``./dev env vllm_omni`` builds with ``./dev engines``' recipe when missing or stale.
One run starts a ``LocalCluster`` (a real ``mooncake_master`` plus a store host process, its
pool prefaulted: a long-running store host's pages are all faulted in, and over TCP only
``--prefault`` does that up front; every store row gains from it alike) and a peer
process (this file with ``--peer``). The peer is the producer stage, this process the
consumer; both build every connector through vLLM-Omni's ``OmniConnectorFactory`` after
vLLM's plugin loader ran (the adapter's entry point registers its name).

The payload is what the issue names: a dict holding a bf16 latent
``[1, 16, T, 64, 64]`` of 16, 64 or 256 MiB plus a small int, one fresh key per put.
Timed per transfer: the peer's ``put(...)`` (from the call until it returns) plus this
process's ``get(...)`` right after (until it returns the dict); GB/s = latent bytes / that
sum (each row also gives the median put and get apart). Connectors, all in one run,
round-robin per repeat (order flipped every other repeat):

    ours_store     MooncakeDiffusionConnector, transfer_mode: store (the default): tensors
                   put_from the producer's memory into the store host, read into fresh
                   tensors (from 256 KiB a direct read: the replica's address from the
                   master, then, the store host being on this host, one
                   ``process_vm_readv`` copy out of it; not Mooncake's get, which goes
                   through loopback TCP); the handle in a Store mailbox record
    ours_p2p       MooncakeDiffusionConnector, transfer_mode: p2p: the producer keeps the
                   tensor, the consumer's get pulls it (same host: one memory copy)
    core_store     core's own store mode on the same latent, no vLLM-Omni and no key:
                   ``DiffusionConnector("denoise", "store")`` in the peer with the latent
                   registered once, ``publish`` + ``wait`` timed as the put; here
                   ``consume(handle, dst=dst)`` into a destination registered once, timed as
                   the get (it removes the delete-on-consume object). The ceiling for
                   ours_store: ``store_vs_core_store_64mb`` is ours_store / core_store
    builtin_store  vLLM-Omni's MooncakeStoreConnector. Shims, the smallest that make it run
                   with mooncake 0.3.13: ``ReplicateConfig`` is wrapped in a subclass that
                   accepts the removed ``with_soft_pin`` attribute and sets
                   ``soft_pin_action = ENABLE`` (the same pinning); ``localbuf`` is raised
                   from its 64 MB default (which rejects larger payloads) to 9/8 of the
                   largest payload: for 256 MiB, 257-280 MiB still fail (rc -600, its
                   allocator), 288 MiB is the smallest 8 MiB step that works; ``metadata_server:
                   P2PHANDSHAKE`` (no HTTP metadata server here). Its ``cleanup`` is a
                   no-op, so this process removes each key after the timed get (untimed)
                   to keep its segments from filling.
    builtin_shm    vLLM-Omni's SharedMemoryConnector (/dev/shm, key-addressed), as shipped
    raw_store      Mooncake alone, no code of ours: a bare ``MooncakeDistributedStore`` per
                   process (the same setup arguments as core's client), the latent
                   registered once in the peer, ``put_from`` of it as one object timed as
                   the put, ``get_into`` a destination registered once here plus the
                   ``remove`` timed as the get (our get removes what it took, so the
                   ceiling pays the same). The ceiling of any path through Mooncake's
                   own put and get (whose wait spins a core; our direct reads do not
                   use it, so ours_store can pass it): ``ceiling_vs_builtin_*`` are
                   raw_store against the built-in connectors, as the ``vs_builtin_*``
                   figures are ours_store; ``store_vs_raw_store_64mb`` is ours_store /
                   raw_store

Also per connector: ``get`` of a key nobody put (p50 over a few calls; the built-in
store connector polls 20 x 50 ms before it gives up; raw_store: one ``get_into`` of a
missing key), and ``small_put_ms`` / ``small_get_ms``, the p50 put and get of a small
object (``{"x": 1 KiB tensor, "step": i}``; raw_store: 1 KiB ``put_from`` / ``get_into``
plus ``remove``; core_store: not measured), after 16 untimed rounds of every
connector (``SMALL_WARMUP``); these come first, so the missing-key gets and the round
trip are timed on warm clients too. Both are timed round-robin, every connector once a
round and the order flipped every round, as the large transfers are. Ours is two
master round trips each way by design: a put checks the key first (Mooncake reports a
put of an existing key as done without writing it, and a second send replaces the
first), a get reads the record and removes it (raw_store's get times its remove too).
The summary's ``miss_vs_raw``,
``small_get_vs_raw`` and ``small_put_vs_raw`` are ours_store's costs over raw_store's
(bare Mooncake calls), and ``store_rtt_ms`` one bare master round trip in the same run
(p50 of ``is_exist`` of a missing key): a bare ``get_into`` of a present object costs more than
that, since its bytes go through the Transfer Engine.
Every connector's first transfer of each size is checked byte for byte (SHA-256 of the
latent) against the producer's.
``ratio`` = ours_store throughput / the row's; the summary's ``vs_builtin_store_64mb`` and
``vs_builtin_store_256mb`` are ours_store / builtin_store at those sizes (``*_p2p``: with
ours_p2p), ``vs_builtin_shm_min`` the smallest ours_store / builtin_shm over the sizes,
``store_vs_core_store_64mb`` ours_store / core_store at 64 MiB: each from the medians.
Spread: every repeat runs every connector once, so each ratio is also taken per repeat
(paired samples, the same stretch of machine noise); ``spread`` in the summary gives
[min, median, max] of those per-repeat ratios, and each row its min / median / max
seconds.
Small-payload sweep (``small_sweep`` in the JSON): ours_store against builtin_store
alone, ``{"x": float32 tensor of N bytes, "step": i}`` for N = 1 KiB, 4 KiB, 64 KiB,
256 KiB and 1 MiB, through the same ``put`` / ``get`` calls (put timed in the peer, get
here, the builtin's key removed after its timed get, untimed): per size
``SMALL_WARMUP`` untimed rounds of both, then ``--sweep-repeats`` timed rounds (1000;
``--quick`` 300), the two alternating and the order flipped every round. It runs last,
after the large transfers, so every figure above is measured as before it existed.
Per size: the p50s in ms, ``put_vs_builtin`` / ``get_vs_builtin`` = ours p50 / builtin
p50 (below 1: ours faster; the summary's ``small_put_vs_builtin`` /
``small_get_vs_builtin`` by size) and ``paired_*``, the median of the per-round ratios;
``sides`` says what each side does within its timed calls (ours delivers exactly once
and removes its keys; the builtin does neither).
``--ours-extra JSON`` merges settings into ours' connector ``extra`` (both ours rows),
e.g. a larger ``inline_bytes``; the config records it.
``--quick`` runs the same sizes and connectors as the full run with 3 repeats instead of 7
(and 300 sweep rounds a size instead of 1000).
Absolute times on this shared 2-vCPU machine are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# This file is named like the engine's package: keep its folder (for _common) behind
# site-packages, so `import vllm_omni` finds vLLM-Omni, not this script.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE] + [_HERE]

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "vllm_omni"
MIB = 1 << 20
SMALL = 1024  # bytes of the small object's tensor
#: untimed small puts and gets per connector before the timed ones: the first dozen
#: transfers through a fresh Mooncake client and store host take 3-4 ms instead of
#: 0.3-0.6 (measured here; its TCP transport warms up), which a serving process is
#: long past, and the row measured first would pay it alone. They run before any
#: other timed figure of the run.
SMALL_WARMUP = 16
#: the small-payload sweep (issue 57): ours_store against builtin_store only, each put
#: ``{"x": float32 tensor of this many bytes, "step": i}``
SWEEP_SIZES = (1 << 10, 4 << 10, 64 << 10, 256 << 10, 1 << 20)
SWEEP_ROWS = ("ours_store", "builtin_store")
#: what each side of the sweep did within its timed put and get (written to the JSON)
SWEEP_SIDES = {
    "ours_store": "MooncakeDiffusionConnector, store mode, default settings unless "
    "config.ours_extra says otherwise: delivers each key exactly once (a claim, a "
    "lease where the record names a payload, a commit) and removes every store key "
    "of the put (record, anchor, markers, payload) within the timed get",
    "builtin_store": "vLLM-Omni's MooncakeStoreConnector with the shims above: one "
    "Mooncake put of the serialized object, one get; no exactly-once (every get of a "
    "key returns it) and it never removes what it stores (this bench removes each key "
    "after the timed get, untimed)",
}
NAME = "MooncakeDiffusionConnector"
ROWS = ("ours_store", "ours_p2p", "core_store", "raw_store", "builtin_store", "builtin_shm")
FACTORY_NAME = {
    "ours_store": NAME,
    "ours_p2p": NAME,
    "builtin_store": "MooncakeStoreConnector",
    "builtin_shm": "SharedMemoryConnector",
}


# ------------------------------------------------------------------ environment
def ensure_engine_venv() -> Path:
    """The engine environment's python, built by ``./dev env vllm_omni`` (the one recipe
    ``./dev engines`` uses; it rebuilds only when an input file changed)."""
    out = subprocess.run(
        [str(ROOT / "dev"), "env", ENGINE], check=True, stdout=subprocess.PIPE, text=True
    )
    # not resolved: the venv's python is a symlink, and its own path makes it the venv's
    return ROOT / out.stdout.strip().splitlines()[-1]


def prepare_process() -> None:
    """vllm pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load next to
    the CPU torch; mark them absent (as tests/engines/vllm_omni/vo_cpu_env.py does).

    Without a GPU, also turn off the background builds of ``humming`` (a kernel library
    vllm imports), as that file does: each import of vllm starts two Python processes
    that compile GPU kernel helpers and cannot succeed here, about 2 s of a core each.
    Left on, the two processes of this bench start four while the first rows are
    measured, and those rows pay for CPU that no connector uses. (The engine
    environment's torch is a CUDA build, so "no GPU" is no NVIDIA device node, which
    asks nothing of CUDA before vllm does.)"""
    import torch

    if torch.version.cuda is None or not glob.glob("/dev/nvidia[0-9]*"):
        os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    if torch.version.cuda is None:
        for name in ("torchvision", "torchaudio", "torchcodec"):
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def shim_builtin_store() -> None:
    """Let vLLM-Omni's MooncakeStoreConnector run on mooncake 0.3.13 (see the docstring)."""
    import mooncake.store as mstore
    from vllm_omni.distributed.omni_connectors.connectors import mooncake_store_connector as m

    class SoftPinConfig(mstore.ReplicateConfig):  # accepts the removed attribute
        def __init__(self) -> None:
            super().__init__()
            self.soft_pin_action = mstore.SoftPinAction.ENABLE

    m.ReplicateConfig = SoftPinConfig


def factory() -> Any:
    from vllm.plugins import load_general_plugins
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    load_general_plugins()
    shim_builtin_store()
    return OmniConnectorFactory


def extras(
    master: str, admin: str, localbuf: int, ours_extra: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    ours = {"master": master, "admin": admin, "host": "127.0.0.1", "ttl_s": 600}
    ours.update(ours_extra or {})
    return {
        "ours_store": {**ours, "transfer_mode": "store"},
        "ours_p2p": {**ours, "transfer_mode": "p2p"},
        "builtin_store": {
            "host": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "master": master,
            "segment": 2 * localbuf,
            "localbuf": localbuf,
            "proto": "tcp",
        },
        "builtin_shm": {},
    }


def build(factory_cls: Any, row: str, extra: dict[str, Any]) -> Any:
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    return factory_cls.create_connector(ConnectorSpec(name=FACTORY_NAME[row], extra=dict(extra)))


def latent_shape(mb: int) -> tuple[int, ...]:
    return (1, 16, mb * MIB // 2 // (16 * 64 * 64), 64, 64)


def latent_dict(mb: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    latent = torch.randint(-32768, 32767, latent_shape(mb), dtype=torch.int16, generator=g)
    return {"latent": latent.view(torch.bfloat16), "step": seed}


def sha(t: Any) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


class RawStore:
    """A bare Mooncake Store client (no code of ours) with buffers registered once."""

    def __init__(self, settings: Any) -> None:
        import mooncake.store as mstore

        self.store = mstore.MooncakeDistributedStore()
        rc = self.store.setup(
            settings.local_hostname, "P2PHANDSHAKE", 0, 0, settings.protocol,
            settings.device, settings.master,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"raw store setup failed ({rc})")
        self.config = mstore.ReplicateConfig()
        self.ptrs: list[int] = []
        from _common import TransientRetry  # a transient -707 is retried, as ours is

        self.retry = TransientRetry()

    def register(self, t: Any) -> int:
        ptr = t.data_ptr()
        if self.store.register_buffer(ptr, t.numel() * t.element_size()) != 0:
            raise RuntimeError("raw store register_buffer failed")
        self.ptrs.append(ptr)
        return ptr

    def put(self, key: str, ptr: int, nbytes: int) -> None:
        rc = self.retry("put_from", lambda: self.store.put_from(key, ptr, nbytes, self.config))
        if rc != 0:
            raise RuntimeError(f"raw store put_from of {key} failed ({rc})")

    def get(self, key: str, ptr: int, nbytes: int) -> int:
        return self.retry("get_into", lambda: self.store.get_into(key, ptr, nbytes))

    def close(self) -> None:
        for ptr in self.ptrs:
            self.store.unregister_buffer(ptr)
        self.store.close()


def small_dict(i: int, nbytes: int = SMALL) -> dict[str, Any]:
    import torch

    return {"x": torch.full((nbytes // 4,), float(i)), "step": i}


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB" if nbytes >= MIB else f"{nbytes >> 10}KiB"


# ------------------------------------------------------------------ the peer (producer)
def peer_main() -> int:
    prepare_process()
    from _common import serve_peer

    state: dict[str, Any] = {"conns": {}, "data": {}}

    def setup(extras: dict[str, dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
        from mooncake_diffusion import DiffusionConnector, MooncakeSettings

        f = factory()
        for row, extra in extras.items():
            state["conns"][row] = build(f, row, extra)
        settings = MooncakeSettings.from_env()
        core = DiffusionConnector("denoise", "store", settings)
        state["core"], state["pubs"] = core, []
        state["raw"] = raw = RawStore(settings)
        state["small"] = small_dict(0)
        state["sweep"] = {n: small_dict(n % 997, n) for n in SWEEP_SIZES}
        raw.register(state["small"]["x"])
        shas = {}
        for mb in sizes:
            state["data"][mb] = latent_dict(mb, mb)
            core.register(state["data"][mb]["latent"])
            raw.register(state["data"][mb]["latent"])
            shas[str(mb)] = sha(state["data"][mb]["latent"])
        return {"shas": shas}

    def put_small(row: str, key: str, nbytes: int = SMALL) -> dict[str, Any]:
        data = state["small"] if nbytes == SMALL else state["sweep"][nbytes]
        t0 = time.perf_counter()
        if row == "raw_store":
            state["raw"].put(key, data["x"].data_ptr(), SMALL)
        elif not state["conns"][row].put("0", "1", key, data)[0]:
            raise RuntimeError(f"{row} put of a small object failed")
        return {"seconds": time.perf_counter() - t0}

    def put(row: str, key: str, mb: int) -> dict[str, Any]:
        from mooncake_diffusion import StagePayload

        data = state["data"][mb]
        if row == "core_store":
            t0 = time.perf_counter()
            pub = state["core"].publish(StagePayload(key, "latent", tensor=data["latent"]))
            pub.wait(60)
            seconds = time.perf_counter() - t0
            state["pubs"].append(pub)
            return {"seconds": seconds, "size": mb * MIB, "handle": pub.encode().hex()}
        if row == "raw_store":
            t = data["latent"]
            t0 = time.perf_counter()
            state["raw"].put(key, t.data_ptr(), mb * MIB)
            return {"seconds": time.perf_counter() - t0, "size": mb * MIB}
        t0 = time.perf_counter()
        ok, size, _ = state["conns"][row].put("0", "1", key, data)
        seconds = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"{row} put of {mb} MiB failed")
        return {"seconds": seconds, "size": size}

    def reap() -> dict[str, Any]:
        for conn in state["conns"].values():
            conn.reap_consumed()
        pubs, state["pubs"] = state.get("pubs", []), []
        for pub in pubs:
            pub.release()
        return {}

    def close() -> dict[str, Any]:
        reap()
        for conn in state["conns"].values():
            conn.close()
        state["conns"].clear()
        if state.get("core") is not None:
            state["core"].close()
            state["core"] = None
        retries = {}
        if state.get("raw") is not None:
            retries = dict(state["raw"].retry.retries)
            state["raw"].close()
            state["raw"] = None
        return {"raw_retries": retries}

    ops = {"setup": setup, "put": put, "put_small": put_small, "reap": reap, "close": close}
    return serve_peer(ops)


# ------------------------------------------------------------------ the bench (consumer)
def run(args: argparse.Namespace) -> dict[str, Any]:
    prepare_process()
    import torch
    from _common import PeerClient

    from mooncake_diffusion import DiffusionConnector, LocalCluster

    sizes = args.sizes
    localbuf = -(-max(sizes) * 9 // 8) * MIB  # smallest that runs: see the docstring
    pool = 3 * max(sizes) * MIB + 256 * MIB
    rows_out: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    # Mooncake's default read lease (5 s) instead of LocalCluster's 1 s test setting: a
    # 256 MiB read on this loaded 2-vCPU machine can take longer than 1 s
    with LocalCluster(pool_bytes=pool, lease_ttl_ms=5000, prefault=True) as cluster:
        s = cluster.settings
        ex = extras(s.master, s.admin_address, localbuf, args.ours_extra)
        peer = PeerClient([sys.executable, __file__, "--peer"], env=dict(os.environ, **s.as_env()))
        try:
            f = factory()  # imports vLLM-Omni here while the peer does the same
            conns = {row: build(f, row, ex[row]) for row in ex}
            core = DiffusionConnector("decode", "store", s, receive_pool_bytes=0)
            dsts = {mb: torch.empty(latent_shape(mb), dtype=torch.bfloat16) for mb in sizes}
            raw = RawStore(s)
            small_dst = torch.empty(SMALL // 4)
            raw.register(small_dst)
            for dst in dsts.values():
                core.register(dst)
                raw.register(dst)
            shas = peer.call("setup", extras=ex, sizes=sizes)["shas"]
            # first: every connector's warm-up (inside smalls_ms), so no timed figure
            # below, misses included, lands on a cold client or store host
            small_rows = [row for row in ROWS if row != "core_store"]
            smalls = smalls_ms(peer, conns, raw, small_dst, small_rows, args.miss_repeats * 3)
            misses = misses_ms(conns, raw, small_dst, args.miss_repeats)
            rtt_ms = rtt(raw, args.miss_repeats * 5)
            n = 0
            for mb in sizes:
                times: dict[str, list[float]] = {row: [] for row in ROWS}
                parts: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
                for rep in range(args.warmup + args.repeats):
                    order = ROWS if rep % 2 == 0 else tuple(reversed(ROWS))
                    for row in order:
                        n += 1
                        key = f"bench-{row}-{mb}-{n}"
                        put = peer.call("put", row=row, key=key, mb=mb)
                        t0 = time.perf_counter()
                        if row == "core_store":
                            with core.consume(bytes.fromhex(put["handle"]), dst=dsts[mb]) as g:
                                g.wait()
                            got = ({"latent": dsts[mb]}, mb * MIB)
                        elif row == "raw_store":  # the remove timed, as our take's is
                            n_read = raw.get(key, dsts[mb].data_ptr(), mb * MIB)
                            raw.store.remove(key, True)
                            got = ({"latent": dsts[mb]}, n_read) if n_read == mb * MIB else None
                        else:
                            got = conns[row].get("0", "1", key)
                        get_s = time.perf_counter() - t0
                        if got is None:
                            raise RuntimeError(f"{row}: {key} not found after its put")
                        if rep == 0:
                            assert sha(got[0]["latent"]) == shas[str(mb)], f"{row} corrupted"
                        del got
                        if row == "builtin_store":  # its cleanup() is a no-op (untimed)
                            conns[row].store.remove(conns[row]._make_key(key, "0", "1"), True)
                        if rep >= args.warmup:
                            times[row].append(put["seconds"] + get_s)
                            parts[row].append((put["seconds"], get_s))
                    peer.call("reap")
                for row in ROWS:
                    med = statistics.median(times[row])
                    rows_out.append(
                        {"size_mb": mb, "connector": row, "seconds": med,
                         "seconds_min": min(times[row]), "seconds_max": max(times[row]),
                         "seconds_all": times[row],
                         "put_seconds": statistics.median(p for p, _ in parts[row]),
                         "get_seconds": statistics.median(g for _, g in parts[row]),
                         "gbps": mb * MIB / med / 1e9, "repeats": len(times[row]),
                         "miss_get_ms": misses.get(row),
                         "small_put_ms": smalls.get(row, {}).get("put_ms"),
                         "small_get_ms": smalls.get(row, {}).get("get_ms")}
                    )  # fmt: skip
            # last: the figures above are measured as before the sweep existed
            sweep = sweep_ms(peer, conns, args.sweep_repeats)
            for conn in conns.values():
                conn.close()
            core.close()
            raw_retries = dict(raw.retry.retries)
            raw.close()
            for what, n in peer.call("close").get("raw_retries", {}).items():
                raw_retries[f"peer {what}"] = n
            left = cluster.keys()
        finally:
            peer.close()
    base = {(r["size_mb"], r["connector"]): r for r in rows_out}
    for r in rows_out:
        r["ratio"] = round(base[(r["size_mb"], "ours_store")]["gbps"] / r["gbps"], 3)

    def vs(row: str, mb: int, ours: str = "ours_store") -> float | None:
        if (mb, row) not in base:
            return None
        return round(base[(mb, ours)]["gbps"] / base[(mb, row)]["gbps"], 2)

    def per_repeat(row: str, mb: int, ours: str = "ours_store") -> list[float]:
        """ours / row throughput in each repeat (paired: the same stretch of noise)."""
        if (mb, row) not in base:
            return []
        a, b = base[(mb, ours)]["seconds_all"], base[(mb, row)]["seconds_all"]
        return [y / x for x, y in zip(a, b, strict=True)]

    def spread(row: str, mbs: list[int], ours: str = "ours_store") -> list[float] | None:
        """[min, median, max] of the per-repeat ratio (the smallest over ``mbs`` per
        repeat)."""
        series = [per_repeat(row, mb, ours) for mb in mbs]
        if not all(series):
            return None
        worst = [min(v) for v in zip(*series, strict=True)]
        return [round(v, 2) for v in (min(worst), statistics.median(worst), max(worst))]

    first = {r["connector"]: r for r in rows_out if r["size_mb"] == sizes[0]}
    ours, bare = first["ours_store"], first["raw_store"]  # per-connector, not per-size
    summary = {
        "store_vs_core_store_64mb": vs("core_store", 64),
        "ceiling_vs_builtin_store_64mb": vs("builtin_store", 64, "raw_store"),
        "ceiling_vs_builtin_shm_min": min(vs("builtin_shm", mb, "raw_store") or 0 for mb in sizes),
        "store_vs_raw_store_64mb": vs("raw_store", 64),
        "vs_builtin_store_64mb": vs("builtin_store", 64),
        "vs_builtin_store_256mb": vs("builtin_store", 256),
        "vs_builtin_shm_min": min(vs("builtin_shm", mb) or 0 for mb in sizes),
        "vs_builtin_store_64mb_p2p": vs("builtin_store", 64, "ours_p2p"),
        "vs_builtin_store_256mb_p2p": vs("builtin_store", 256, "ours_p2p"),
        "vs_builtin_shm_min_p2p": min(vs("builtin_shm", mb, "ours_p2p") or 0 for mb in sizes),
        "store_rtt_ms": rtt_ms,
        "small_put_vs_builtin": {k: v["put_vs_builtin"] for k, v in sweep["sizes"].items()},
        "small_get_vs_builtin": {k: v["get_vs_builtin"] for k, v in sweep["sizes"].items()},
        "miss_vs_raw": round(ours["miss_get_ms"] / bare["miss_get_ms"], 2),
        "small_get_vs_raw": round(ours["small_get_ms"] / bare["small_get_ms"], 2),
        "small_put_vs_raw": round(ours["small_put_ms"] / bare["small_put_ms"], 2),
        "spread": {
            "store_vs_core_store_64mb": spread("core_store", [64]),
            "ceiling_vs_builtin_store_64mb": spread("builtin_store", [64], "raw_store"),
            "ceiling_vs_builtin_shm_min": spread("builtin_shm", sizes, "raw_store"),
            "store_vs_raw_store_64mb": spread("raw_store", [64]),
            "vs_builtin_store_64mb": spread("builtin_store", [64]),
            "vs_builtin_store_256mb": spread("builtin_store", [256]),
            "vs_builtin_shm_min": spread("builtin_shm", sizes),
            "vs_builtin_store_64mb_p2p": spread("builtin_store", [64], "ours_p2p"),
            "vs_builtin_shm_min_p2p": spread("builtin_shm", sizes, "ours_p2p"),
        },
        "repeats": args.repeats,
        "store_keys_left": len(left),
        "raw_retries": raw_retries,  # transient Mooncake codes retried by raw_store
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    config = {"quick": args.quick, "sizes_mb": sizes, "repeats": args.repeats,
              "warmup": args.warmup, "miss_repeats": args.miss_repeats,
              "sweep_repeats": args.sweep_repeats, "ours_extra": args.ours_extra}  # fmt: skip
    return {"bench": "vllm_omni", "machine": machine_info(), "config": config,
            "rows": rows_out, "summary": summary, "small_sweep": sweep}  # fmt: skip


def misses_ms(conns: dict[str, Any], raw: RawStore, dst: Any, repeats: int) -> dict[str, float]:
    """p50 ``get`` of a key nobody put, per connector (raw_store: one bare ``get_into``),
    after one untimed each (a client's first store call pays its connection set-up).
    Round-robin: every connector once a round, the order flipped every round."""

    def miss(row: str, key: str) -> bool:
        if row == "raw_store":
            return raw.get(key, dst.data_ptr(), SMALL) < 0
        return conns[row].get("0", "1", key) is None

    rows = [*conns, "raw_store"]
    samples: dict[str, list[float]] = {row: [] for row in rows}
    for i in range(-1, repeats):
        for row in rows if i % 2 == 0 else rows[::-1]:
            t0 = time.perf_counter()
            assert miss(row, f"bench-never-put-{row}-{i}"), row
            if i >= 0:
                samples[row].append((time.perf_counter() - t0) * 1e3)
    return {row: round(statistics.median(v), 3) for row, v in samples.items()}


def rtt(raw: RawStore, repeats: int) -> float:
    """p50 of one bare ``is_exist`` of a missing key (one master round trip), in ms."""
    samples = []
    for i in range(repeats):
        t0 = time.perf_counter()
        assert raw.store.is_exist(f"bench-never-put-rtt-{i}") == 0
        samples.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(samples), 3)


def small_round(
    peer: Any, conn: Any, raw: RawStore | None, dst: Any, row: str, key: str, nbytes: int = SMALL
) -> tuple[float, float]:
    """One put (in the peer) and get (here) of a small object (``nbytes`` of tensor)
    through ``row``: ms each. Checks what came back (untimed)."""
    put = peer.call("put_small", row=row, key=key, nbytes=nbytes)
    t0 = time.perf_counter()
    if row == "raw_store":  # the remove timed, as our take's is
        assert raw is not None
        ok = raw.get(key, dst.data_ptr(), SMALL) == SMALL
        raw.store.remove(key, True)
    else:
        got = conn.get("0", "1", key)
        ok = got is not None and got[0]["x"].numel() * 4 == nbytes
    get_s = time.perf_counter() - t0
    if not ok:
        raise RuntimeError(f"{row}: small {key} not found, or not whole, after its put")
    if row == "builtin_store":
        conn.store.remove(conn._make_key(key, "0", "1"), True)
    return put["seconds"] * 1e3, get_s * 1e3


def smalls_ms(
    peer: Any, conns: dict[str, Any], raw: RawStore, dst: Any, rows: list[str], repeats: int
) -> dict[str, dict[str, float]]:
    """p50 put and get of a small object per row: ``SMALL_WARMUP`` untimed rounds of
    every row first, then ``repeats`` timed rounds, every row once a round and the
    order flipped every round (as the large transfers), so no row is timed alone in
    a stretch of machine noise or right after the set-up."""
    for i in range(SMALL_WARMUP):
        for row in rows:
            small_round(peer, conns.get(row), raw, dst, row, f"bench-small-{row}-w{i}")
    samples: dict[str, tuple[list[float], list[float]]] = {row: ([], []) for row in rows}
    for i in range(repeats):
        for row in rows if i % 2 == 0 else rows[::-1]:
            put, get = small_round(peer, conns.get(row), raw, dst, row, f"bench-small-{row}-{i}")
            samples[row][0].append(put)
            samples[row][1].append(get)
    return {
        row: {
            "put_ms": round(statistics.median(puts), 3),
            "get_ms": round(statistics.median(gets), 3),
        }
        for row, (puts, gets) in samples.items()
    }


def sweep_ms(peer: Any, conns: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The small-payload sweep: per size of ``SWEEP_SIZES``, p50 put and get of
    ours_store and builtin_store through vLLM-Omni's connector interface, as
    ``smalls_ms`` times them (``SMALL_WARMUP`` untimed rounds of both rows per size,
    then ``repeats`` timed ones, the two rows alternating and the order flipped
    every round, so machine noise hits both). ``*_vs_builtin`` = ours p50 / builtin
    p50 (below 1: ours faster); ``paired_*`` the median of the per-round ratios."""
    out: dict[str, Any] = {
        "repeats": repeats,
        "warmup": SMALL_WARMUP,
        "sides": SWEEP_SIDES,
        "sizes": {},
    }
    rows = list(SWEEP_ROWS)
    t0 = time.perf_counter()
    for nbytes in SWEEP_SIZES:
        label = size_label(nbytes)
        for i in range(SMALL_WARMUP):
            for row in rows:
                key = f"bench-sw{label}-{row}-w{i}"
                small_round(peer, conns[row], None, None, row, key, nbytes)
        puts: dict[str, list[float]] = {row: [] for row in rows}
        gets: dict[str, list[float]] = {row: [] for row in rows}
        for i in range(repeats):
            for row in rows if i % 2 == 0 else rows[::-1]:
                key = f"bench-sw{label}-{row}-{i}"
                put, get = small_round(peer, conns[row], None, None, row, key, nbytes)
                puts[row].append(put)
                gets[row].append(get)
        med = {row: (statistics.median(puts[row]), statistics.median(gets[row])) for row in rows}
        (op, og), (bp, bg) = med["ours_store"], med["builtin_store"]

        def paired(ours: list[float], base: list[float]) -> float:
            return round(statistics.median(a / b for a, b in zip(ours, base, strict=True)), 2)

        out["sizes"][label] = {
            "bytes": nbytes,
            "ours_put_ms": round(op, 3),
            "ours_get_ms": round(og, 3),
            "builtin_put_ms": round(bp, 3),
            "builtin_get_ms": round(bg, 3),
            "put_vs_builtin": round(op / bp, 2),
            "get_vs_builtin": round(og / bg, 2),
            "paired_put_vs_builtin": paired(puts["ours_store"], puts["builtin_store"]),
            "paired_get_vs_builtin": paired(gets["ours_store"], gets["builtin_store"]),
        }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def machine_info() -> dict[str, Any]:
    import importlib.metadata

    import torch

    versions = {}
    for d in ("vllm", "vllm-omni", "mooncake-transfer-engine-non-cuda", "mooncake-diffusion"):
        try:
            versions[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "packages": versions,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| size | connector | seconds (median) | min-max | GB/s | ours_store speedup "
        "| missing-key get ms | small put / get ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in result["rows"]:
        lines.append(
            f"| {r['size_mb']} MiB | {r['connector']} | {r['seconds']:.4f} | "
            f"{r['seconds_min']:.4f}-{r['seconds_max']:.4f} | {r['gbps']:.2f} | "
            f"{r['ratio']:.2f} | {ms(r['miss_get_ms'])} | "
            f"{ms(r['small_put_ms'])} / {ms(r['small_get_ms'])} |"
        )
    s = result["summary"]
    sweep = result["small_sweep"]
    lines += [
        "",
        f"Small-payload sweep ({sweep['repeats']} timed rounds a size, p50 ms):",
        "",
        "| size | ours put / get | builtin put / get | put / get vs builtin |",
        "|---:|---:|---:|---:|",
    ]
    for label, v in sweep["sizes"].items():
        lines.append(
            f"| {label} | {v['ours_put_ms']:.2f} / {v['ours_get_ms']:.2f} | "
            f"{v['builtin_put_ms']:.2f} / {v['builtin_get_ms']:.2f} | "
            f"{v['put_vs_builtin']:.2f} / {v['get_vs_builtin']:.2f} |"
        )
    lines += [
        "",
        "builtin_store ran with shims: ReplicateConfig subclass accepting with_soft_pin "
        "(sets soft_pin_action=ENABLE), localbuf raised to 9/8 of the largest payload, "
        "metadata_server P2PHANDSHAKE; keys removed after each timed get (its cleanup is a "
        "no-op). builtin_shm ran as shipped. Every store row used one store host whose "
        "pool was prefaulted (as a long-running one's pages are), on this host: ours_store "
        "and core_store read large objects out of it with process_vm_readv (a store host "
        "on another host is read over the network); raw_store and builtin_store read "
        "through Mooncake's get over loopback TCP, which has no such shortcut.",
        "Summary: " + ", ".join(f"`{k}` {v}" for k, v in s.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 repeats instead of 7, 300 sweep rounds instead of 1000 (same sizes, connectors)",
    )
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--sizes-mb", default="16,64,256")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--sweep-repeats",
        type=int,
        default=None,
        help="timed rounds a size of the small-payload sweep (default 1000; --quick 300)",
    )
    p.add_argument(
        "--ours-extra",
        type=json.loads,
        default=None,
        help="JSON object merged into ours' connector extra (e.g. "
        '\'{"inline_bytes": 2097152, "max_record": 4194304}\'); recorded in the config',
    )
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return peer_main()
    import importlib.util

    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or spec.origin == str(Path(__file__).resolve()):  # not the engine venv
        py = ensure_engine_venv()
        os.execv(str(py), [str(py), __file__, *(argv if argv is not None else sys.argv[1:])])
    args.sizes = [int(x) for x in args.sizes_mb.split(",") if x]
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.warmup = 1
    args.miss_repeats = 3 if args.quick else 5
    args.sweep_repeats = args.sweep_repeats or (300 if args.quick else 1000)
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Transfer benchmark: DiffusionConnector against raw Mooncake, side by side, cross-process.

Run ``uv run python bench/transfer.py [--quick] [--json PATH] [--sizes-mb 1,16,64,256]
[--repeats N]``. One run starts a ``LocalCluster`` (a real ``mooncake_master`` plus a
store host process) and a peer process (this file with ``--peer``), then, for each size,
times these paths after one verified run and warm-up runs each:

    memcpy           in-process ``dst.copy_(src)``: the memory-bandwidth limit. Timed in a
                     loop of its own (torch's copy threads would disturb the paths after it);
                     at small sizes it runs partly from cache, so read it as a ceiling only.
    raw_te_write     raw ``TransferEngine.batch_transfer_sync_write`` from this process into
                     a registered buffer of the peer process (bench -> peer).
    connector_p2p    the peer is a p2p producer (source registered once, payloads published
                     ahead); timed: ``consume(handle, dst=dst)`` here, i.e. the side-channel
                     request plus the producer's ``batch_transfer_sync_write`` (peer -> bench).
                     The consumer has the same-host path turned off, so this is the network.
    connector_same_host  the same, with the same-host path on, consumed into the connector's
                     shared receive pool: the producer memcpys into its mapping of that
                     memfd (first use maps it; warm-up covers that); compared with memcpy.
    raw_store        raw ``MooncakeDistributedStore``: timed ``batch_put_from`` (hard pin) +
                     ``batch_get_into`` + ``batch_remove``; the bytes live in the store host.
    connector_store  store-mode producer and consumer connectors in this process; timed:
                     ``publish`` + ``wait`` + ``consume(handle, dst=dst)`` (the consume
                     removes the delete-on-consume object), i.e. the same put + get + remove.

The four Mooncake paths run round-robin (one run of each per repeat, the order flipped on
every other repeat), so machine noise hits them alike. Then the fixed cost of a 4 KiB round
trip (publish, wait, consume, release of the received payload) for p2p and store, both
connectors in this process (each has its own Transfer Engine, so bytes still cross loopback
TCP), as p50/p90 over many iterations.

Reading the output: sizes are MiB (2**20 bytes), throughput is GB/s (1e9 bytes/s), seconds
are medians over repeats. ``ratio`` is a throughput ratio of a connector path to the raw
Mooncake path doing the same work: connector_p2p / raw_te_write and connector_store /
raw_store. 1.0 means the connector adds nothing; 0.9 means it costs 10 %. The raw rows are
the base; memcpy has no ratio (its GB/s is the ceiling for every path). Every path's bytes
are checked once per size against the source, so a fast-but-wrong path cannot win. This
machine is small and noisy: read ratios near 1.0 as "within noise". On a 2-vCPU VM with a
250 Hz kernel, a thread handoff that loses its CPU to a busy thread costs a whole 4 ms tick;
4 ms and 8 ms outliers in the round trips are that.

Handles travel between processes as bytes (hex in JSON lines over the peer's stdin/stdout);
nothing is pickled.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from _common import PeerClient, TransientRetry, Unmeasured, connector, serve_peer

from mooncake_diffusion import DiffusionConnector, LocalCluster, MooncakeSettings, StagePayload

MIB = 1 << 20
ROUNDTRIP_BYTES = 4096
RAW_KEY_ROOT = "bench-raw/"
TIMED = {
    "memcpy": "dst.copy_(src) in the bench process",
    "raw_te_write": "batch_transfer_sync_write bench -> peer process (one call)",
    "connector_p2p": "consume(handle, dst) in the bench process; peer produced (peer -> bench)",
    "connector_same_host": "as connector_p2p, same-host memcpy into the shared receive pool",
    "raw_store": "batch_put_from (hard pin) + batch_get_into + batch_remove(force)",
    "connector_store": "publish + wait + consume(handle, dst) (consume removes the object)",
    "roundtrip_4k": "publish + wait + consume(handle, dst) + received.release(), 4 KiB",
}
BASE_OF = {
    "connector_p2p": "raw_te_write",
    "connector_store": "raw_store",
    "connector_same_host": "memcpy",
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def make_pattern(nbytes: int) -> torch.Tensor:
    """Deterministic, position-dependent bytes (same in bench and peer); ``nbytes % 4 == 0``."""
    words = torch.arange(nbytes // 4, dtype=torch.int32).mul_(-1640531535)  # Knuth hash
    return words.view(torch.uint8)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"verification failed: {what}")


def check_rc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with Mooncake code {rc}")


# --------------------------------------------------------------------------- peer process
class Peer:
    """The peer process: a raw TE destination and a p2p producer connector."""

    def __init__(self, settings: MooncakeSettings, max_bytes: int) -> None:
        self.settings = settings
        self.src = make_pattern(max_bytes)
        self.te_buf = torch.zeros(max_bytes, dtype=torch.uint8)
        self.te: Any = None
        self.prod: DiffusionConnector | None = None
        self.pubs: list[Any] = []

    def te_setup(self) -> dict[str, Any]:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        s = self.settings
        check_rc(self.te.initialize(s.local_hostname, "P2PHANDSHAKE", "tcp", ""), "TE init")
        ptr = self.te_buf.data_ptr()
        check_rc(self.te.register_memory(ptr, self.te_buf.numel(), "*"), "TE register")
        return {"segment": f"{s.local_hostname}:{self.te.get_rpc_port()}", "addr": ptr}

    def te_check(self, n: int) -> dict[str, Any]:
        ok = torch.equal(self.te_buf[:n], self.src[:n])
        self.te_buf[:n].zero_()
        return {"equal": ok}

    def p2p_setup(self) -> dict[str, Any]:
        self.prod = DiffusionConnector("denoise", "p2p", self.settings)
        self.prod.register(self.src)
        return {}

    def p2p_publish(self, n: int, k: int, tag: str) -> dict[str, Any]:
        assert self.prod is not None
        handles = []
        for i in range(k):
            payload = StagePayload(request_id=f"{tag}-{i}", kind="latent", tensor=self.src[:n])
            pub = self.prod.publish(payload)
            pub.wait(30)
            self.pubs.append(pub)
            handles.append(pub.encode().hex())
        return {"handles": handles}

    def close(self) -> dict[str, Any]:
        for pub in self.pubs:
            pub.release()
        if self.prod is not None:
            self.prod.close()
        if self.te is not None:
            self.te.unregister_memory(self.te_buf.data_ptr())
            self.te = None
        return {}


def peer_main(settings: MooncakeSettings, max_bytes: int) -> int:
    peer = Peer(settings, max_bytes)
    return serve_peer(
        {
            "te_setup": peer.te_setup,
            "te_check": peer.te_check,
            "p2p_setup": peer.p2p_setup,
            "p2p_publish": peer.p2p_publish,
            "close": peer.close,
        }
    )


def start_peer(settings: MooncakeSettings, max_bytes: int) -> PeerClient:
    argv = [sys.executable, os.path.abspath(__file__), "--peer"]
    argv += [f"--master={settings.master}", f"--admin={settings.admin_address}"]
    return PeerClient([*argv, f"--max-bytes={max_bytes}"])


# --------------------------------------------------------------------------- paths
class Path:
    """One way of moving ``n`` bytes; ``run`` returns the timed seconds."""

    name = ""

    def prepare(self, n: int, count: int) -> None:
        """Called once per size before ``count`` calls of verify/run."""

    def verify(self, n: int) -> None:
        raise NotImplementedError

    def run(self, n: int) -> float:
        raise NotImplementedError


class Memcpy(Path):
    name = "memcpy"

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.src, self.dst = src, dst

    def run(self, n: int) -> float:
        t = time.perf_counter()
        self.dst[:n].copy_(self.src[:n])
        return time.perf_counter() - t

    def verify(self, n: int) -> None:
        self.dst[:n].zero_()
        self.run(n)
        check(torch.equal(self.dst[:n], self.src[:n]), f"memcpy {n}")


class RawTeWrite(Path):
    """Raw Transfer Engine: this process writes its registered src into the peer's buffer."""

    name = "raw_te_write"

    def __init__(self, settings: MooncakeSettings, src: torch.Tensor, peer: PeerClient) -> None:
        from mooncake.engine import TransferEngine

        self.src, self.peer = src, peer
        self.te = TransferEngine()
        init = self.te.initialize(settings.local_hostname, "P2PHANDSHAKE", "tcp", "")
        check_rc(init, "TE init")
        check_rc(self.te.register_memory(src.data_ptr(), src.numel(), "*"), "TE register")
        target = peer.call("te_setup")
        self.segment, self.addr = target["segment"], int(target["addr"])

    def run(self, n: int) -> float:
        ptr = self.src.data_ptr()
        t = time.perf_counter()
        rc = self.te.batch_transfer_sync_write(self.segment, [ptr], [self.addr], [n])
        dt = time.perf_counter() - t
        check_rc(rc, "batch_transfer_sync_write")
        return dt

    def verify(self, n: int) -> None:
        self.run(n)  # the peer's buffer was zeroed by its previous check (or is fresh)
        check(self.peer.call("te_check", n=n)["equal"], f"raw_te_write {n}")

    def close(self) -> None:
        self.te.unregister_memory(self.src.data_ptr())


class ConnectorP2P(Path):
    """The peer publishes p2p payloads ahead of time; this process times ``consume``."""

    name = "connector_p2p"

    def __init__(self, cons: DiffusionConnector, dst: torch.Tensor, peer: PeerClient) -> None:
        self.cons, self.dst, self.peer = cons, dst, peer
        self.handles: deque[bytes] = deque()
        self.batches = 0
        peer.call("p2p_setup")

    def prepare(self, n: int, count: int) -> None:
        self.batches += 1
        reply = self.peer.call("p2p_publish", n=n, k=count, tag=f"{self.name}-{self.batches}")
        self.handles.extend(bytes.fromhex(h) for h in reply["handles"])

    def run(self, n: int) -> float:
        handle = self.handles.popleft()
        t = time.perf_counter()
        got = self.cons.consume(handle, dst=self.dst[:n])
        got.release()
        return time.perf_counter() - t

    def verify(self, n: int) -> None:
        self.dst[:n].zero_()
        self.run(n)
        check(torch.equal(self.dst[:n], make_pattern(n)), f"{self.name} {n}")


class ConnectorSameHost(ConnectorP2P):
    """As ``ConnectorP2P``, through a consumer that lets the producer copy directly,
    into the consumer's shared receive pool (no ``dst``): the memcpy path."""

    name = "connector_same_host"

    def run(self, n: int) -> float:
        handle = self.handles.popleft()
        t = time.perf_counter()
        got = self.cons.consume(handle)
        self.last = got.tensor
        got.release()
        return time.perf_counter() - t

    def verify(self, n: int) -> None:
        handle = self.handles.popleft()
        with self.cons.consume(handle) as got:
            check(got.path == "p2p/shm", f"{self.name} went via {got.path}")
            check(torch.equal(got.tensor, make_pattern(n)), f"{self.name} {n}")


class RawStore(Path):
    """Raw Mooncake Store client (no segment of its own: bytes go to the store host)."""

    name = "raw_store"

    def __init__(self, settings: MooncakeSettings, src: torch.Tensor, dst: torch.Tensor) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.src, self.dst = src, dst
        self.store = MooncakeDistributedStore()
        s = settings
        rc = self.store.setup(s.local_hostname, "P2PHANDSHAKE", 0, 0, "tcp", "", s.master)
        check_rc(rc, "store setup")
        for t in (src, dst):
            check_rc(self.store.register_buffer(t.data_ptr(), t.numel()), "store register")
        self.config = ReplicateConfig()
        self.config.with_hard_pin = True  # what the connector uses for delete_on_consume
        self.retry = TransientRetry()
        self.count = 0
        self.split: dict[int, list[tuple[float, float, float]]] = {}

    def run(self, n: int) -> float:
        self.count += 1
        keys = [f"{RAW_KEY_ROOT}{n}/{self.count}"]
        s = self.store
        retry, src, dst = self.retry, self.src.data_ptr(), self.dst.data_ptr()
        t0 = time.perf_counter()
        put = retry("batch_put_from", lambda: s.batch_put_from(keys, [src], [n], self.config)[0])
        t1 = time.perf_counter()
        try:
            got = retry("batch_get_into", lambda: s.batch_get_into(keys, [dst], [n])[0])
        except Unmeasured:
            s.batch_remove(keys, True)  # leave no object behind
            raise
        t2 = time.perf_counter()
        removed = retry("batch_remove", lambda: s.batch_remove(keys, True)[0])
        t3 = time.perf_counter()
        check_rc(put, "batch_put_from")
        check(got == n, f"batch_get_into returned {got}, expected {n}")
        check_rc(removed, "batch_remove")
        self.split.setdefault(n, []).append((t1 - t0, t2 - t1, t3 - t2))
        return t3 - t0

    def verify(self, n: int) -> None:
        self.dst[:n].zero_()
        self.run(n)
        self.split[n].clear()  # keep only timed runs in the put/get/remove split
        check(torch.equal(self.dst[:n], self.src[:n]), f"raw_store {n}")

    def close(self) -> None:
        for t in (self.src, self.dst):
            self.store.unregister_buffer(t.data_ptr())
        self.store.close()


class ConnectorStore(Path):
    """Store-mode producer and consumer connectors, both in this process."""

    name = "connector_store"

    def __init__(
        self,
        prod: DiffusionConnector,
        cons: DiffusionConnector,
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        self.prod, self.cons, self.src, self.dst = prod, cons, src, dst
        self.count = 0

    def run(self, n: int) -> float:
        self.count += 1
        rid = f"store-{n}-{self.count}"
        payload = StagePayload(request_id=rid, kind="latent", tensor=self.src[:n])
        t = time.perf_counter()
        pub = self.prod.publish(payload)
        pub.wait(60)
        got = self.cons.consume(pub.encode(), dst=self.dst[:n])
        got.release()
        # No pub.release(): consume already removed the object, and a release would only
        # add a remove RPC outside the transfer. close() drops the producer's bookkeeping.
        return time.perf_counter() - t

    def verify(self, n: int) -> None:
        self.dst[:n].zero_()
        self.run(n)
        check(torch.equal(self.dst[:n], self.src[:n]), f"connector_store {n}")


# --------------------------------------------------------------------------- measurement
@dataclass
class Row:
    size_bytes: int
    path: str
    seconds: float | None  # None: not measured (``unmeasured`` says why)
    gbps: float | None
    ratio: float | None
    unmeasured: str | None = None


def measure_size(
    paths: list[Path], n: int, warmup: int, repeats: int, unmeasured: dict[str, str]
) -> dict[str, float]:
    """Verify, warm up, then time every path round-robin; returns median seconds by path.

    The order flips on every repeat, so no path always runs right after the same other.
    A path whose raw calls stay transiently failed past their deadline (``Unmeasured``)
    is left out of this size, its reason put in ``unmeasured``.
    """

    def attempt(p: Path, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Unmeasured as e:
            unmeasured[p.name] = str(e)
            log(f"{fmt_size(n)} {p.name}: not measured: {e}")
            return None

    live = list(paths)
    for p in paths:
        p.prepare(n, 1 + warmup + repeats)
        if attempt(p, lambda p=p: [p.verify(n), *(p.run(n) for _ in range(warmup))]) is None:
            live.remove(p)
    times: dict[str, list[float]] = {p.name: [] for p in live}
    for i in range(repeats):
        for p in list(live if i % 2 == 0 else reversed(live)):
            dt = attempt(p, lambda p=p: p.run(n))
            if dt is None:
                live.remove(p)
                del times[p.name]
            else:
                times[p.name].append(dt)
    return {name: statistics.median(ts) for name, ts in times.items()}


def rows_for(n: int, medians: dict[str, float], unmeasured: dict[str, str]) -> list[Row]:
    gbps = {name: n / s / 1e9 for name, s in medians.items()}
    order = [
        "memcpy",
        "connector_same_host",
        "raw_te_write",
        "connector_p2p",
        "raw_store",
        "connector_store",
    ]
    rows = []
    for name in order:
        if name in unmeasured:
            rows.append(Row(n, name, None, None, None, unmeasured[name]))
            continue
        if name not in medians:
            continue
        base = BASE_OF.get(name)
        ratio = gbps[name] / gbps[base] if base in gbps else None
        rows.append(Row(n, name, medians[name], gbps[name], ratio))
    return rows


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def roundtrip(
    prod: DiffusionConnector,
    cons: DiffusionConnector,
    src: torch.Tensor,
    dst: torch.Tensor,
    iterations: int,
    warmup: int,
    tag: str = "",
) -> dict[str, float]:
    """p50/p90 ms of publish + wait + consume + received.release() of one 4 KiB tensor."""
    tag = tag or f"rt-{prod.transfer_mode}"
    dst[:ROUNDTRIP_BYTES].zero_()
    times: list[float] = []
    for i in range(warmup + iterations):
        payload = StagePayload(request_id=f"{tag}-{i}", kind="latent", tensor=src[:ROUNDTRIP_BYTES])
        t = time.perf_counter()
        pub = prod.publish(payload)
        pub.wait(30)
        got = cons.consume(pub.encode(), dst=dst[:ROUNDTRIP_BYTES])
        got.release()
        dt = time.perf_counter() - t  # no pub.release(), as in ConnectorStore.run
        if i == 0:
            check(torch.equal(dst[:ROUNDTRIP_BYTES], src[:ROUNDTRIP_BYTES]), f"{tag} bytes")
        if i >= warmup:
            times.append(dt * 1e3)
    return {"p50_ms": quantile(times, 0.5), "p90_ms": quantile(times, 0.9), "n": iterations}


# --------------------------------------------------------------------------- report
def machine_info() -> dict[str, Any]:
    dists = importlib.metadata.packages_distributions().get("mooncake", [])
    versions = {d: importlib.metadata.version(d) for d in dists}
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mooncake": versions,
    }


def fmt_size(n: int) -> str:
    return f"{n / MIB:g} MiB"


def markdown(rows: list[Row], rt: dict[str, dict[str, float]], retries: dict[str, int]) -> str:
    lines = [
        "| size | path | seconds (median) | GB/s | ratio |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r.seconds is None or r.gbps is None:
            lines.append(f"| {fmt_size(r.size_bytes)} | {r.path} | not measured | - | - |")
            continue
        if r.ratio is not None:
            ratio = f"{r.ratio:.2f}"
        else:
            ratio = "base" if r.path in BASE_OF.values() else "-"
        lines.append(
            f"| {fmt_size(r.size_bytes)} | {r.path} | {r.seconds:.6f} | {r.gbps:.2f} | {ratio} |"
        )
    lines.append("")
    for r in rows:
        if r.unmeasured:
            lines.append(f"not measured: {fmt_size(r.size_bytes)} {r.path}: {r.unmeasured}")
    for what, n in retries.items():
        lines.append(f"retried (transient Mooncake code): {what} x{n}")
    for mode, q in rt.items():
        lines.append(
            f"roundtrip_4k {mode}: p50 {q['p50_ms']:.3f} ms, p90 {q['p90_ms']:.3f} ms "
            f"({q['n']} iterations)"
        )
    return "\n".join(lines)


def summary(rows: list[Row], rt: dict[str, dict[str, float]]) -> dict[str, Any]:
    def min_ratio(path: str) -> float | None:
        ratios = [
            r.ratio
            for r in rows
            if r.path == path and r.size_bytes >= 16 * MIB and r.ratio is not None
        ]
        return min(ratios) if ratios else None

    same_host = [
        r.ratio
        for r in rows
        if r.path == "connector_same_host" and r.size_bytes >= 64 * MIB and r.ratio is not None
    ]
    return {
        "same_host_vs_memcpy": min(same_host) if same_host else None,
        "p2p_vs_raw_te": min_ratio("connector_p2p"),
        "store_vs_raw_store": min_ratio("connector_store"),
        "roundtrip_4k_ms_p50": rt["p2p"]["p50_ms"],
        "roundtrip_4k_ms_p90": rt["p2p"]["p90_ms"],
        "roundtrip_4k_store_ms_p50": rt["store"]["p50_ms"],
        "roundtrip_4k_store_ms_p90": rt["store"]["p90_ms"],
        "roundtrip_4k_same_host_ms_p50": rt["same_host"]["p50_ms"],
    }


def store_split(raw: RawStore) -> dict[str, dict[str, float]]:
    """Median put / get / remove seconds of the timed raw_store runs, by size."""
    out = {}
    for n, runs in raw.split.items():
        if runs:
            put, get, rm = (statistics.median(x) for x in zip(*runs, strict=True))
            out[str(n)] = {"put_s": put, "get_s": get, "remove_s": rm}
    return out


# --------------------------------------------------------------------------- driver
@dataclass
class Config:
    sizes: list[int]
    repeats: int
    warmup: int
    rt_iterations: int
    rt_warmup: int
    quick: bool
    json_path: str | None


def run_all(
    cfg: Config, cluster: LocalCluster
) -> tuple[list[Row], dict[str, Any], dict, dict[str, int]]:
    settings = cluster.settings
    assert settings is not None
    max_bytes = max(cfg.sizes)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        peer = start_peer(settings, max_bytes)
        stack.callback(peer.close)
        src = make_pattern(max_bytes)
        dst = torch.zeros(max_bytes, dtype=torch.uint8)
        log("starting engines and connectors")
        net = dataclasses.replace(settings, same_host=False)
        p2p_cons = stack.enter_context(connector("decode", "p2p", net, dst))
        shm_cons = stack.enter_context(
            connector("decode", "p2p", settings, receive_pool_bytes=max_bytes + (1 << 20))
        )
        st_prod = stack.enter_context(connector("denoise", "store", settings, src))
        st_cons = stack.enter_context(connector("decode", "store", settings, dst))
        raw_te = RawTeWrite(settings, src, peer)
        stack.callback(raw_te.close)
        raw_store = RawStore(settings, src, dst)
        stack.callback(raw_store.close)
        memcpy = Memcpy(src, dst)  # timed on its own: torch's copy threads disturb the others
        paths: list[Path] = [
            raw_te,
            ConnectorP2P(p2p_cons, dst, peer),
            ConnectorSameHost(shm_cons, dst, peer),
            raw_store,
            ConnectorStore(st_prod, st_cons, src, dst),
        ]
        for n in cfg.sizes:
            t = time.perf_counter()
            unmeasured: dict[str, str] = {}
            medians = measure_size([memcpy], n, cfg.warmup, cfg.repeats, unmeasured)
            medians |= measure_size(paths, n, cfg.warmup, cfg.repeats, unmeasured)
            rows += rows_for(n, medians, unmeasured)
            log(f"{fmt_size(n)}: done in {time.perf_counter() - t:.1f} s")
        log(f"4 KiB round trips ({cfg.rt_iterations} per mode)")
        p2p_prod = stack.enter_context(connector("denoise", "p2p", settings, src))
        rt = {
            "p2p": roundtrip(p2p_prod, p2p_cons, src, dst, cfg.rt_iterations, cfg.rt_warmup),
            "same_host": roundtrip(
                p2p_prod, shm_cons, src, dst, cfg.rt_iterations, cfg.rt_warmup, tag="rt-shm"
            ),
            "store": roundtrip(st_prod, st_cons, src, dst, cfg.rt_iterations, cfg.rt_warmup),
        }
        split = store_split(raw_store)
        retries = dict(raw_store.retry.retries)
        log("closing connectors, engines and the peer")
    return rows, rt, split, retries


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="few repeats (finishes in ~30 s)")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON here")
    p.add_argument("--sizes-mb", default="1,16,64,256", help="comma-separated MiB sizes")
    p.add_argument("--repeats", type=int, help="timed runs per path and size")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--admin", help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from(a: argparse.Namespace) -> Config:
    sizes = [int(float(s) * MIB) // 4 * 4 for s in a.sizes_mb.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0:
        raise SystemExit("--sizes-mb needs positive sizes")
    return Config(
        sizes=sizes,
        repeats=a.repeats or (3 if a.quick else 10),
        warmup=1 if a.quick else 2,
        rt_iterations=200 if a.quick else 1000,
        rt_warmup=20 if a.quick else 50,
        quick=a.quick,
        json_path=a.json,
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.peer:
        return peer_main(MooncakeSettings(master=a.master, admin=a.admin), a.max_bytes)
    cfg = config_from(a)
    t0 = time.perf_counter()
    pool = max(1 << 30, 2 * max(cfg.sizes) + 64 * MIB)
    log(
        f"starting LocalCluster (pool {pool / MIB:g} MiB); sizes {[fmt_size(n) for n in cfg.sizes]}"
    )
    with LocalCluster(pool_bytes=pool) as cluster:
        rows, rt, split, retries = run_all(cfg, cluster)
        left = cluster.keys()
    if left:
        log(f"WARNING: {len(left)} store keys left behind: {left[:5]}")
    total = time.perf_counter() - t0
    print(markdown(rows, rt, retries))
    print(f"\ntotal {total:.1f} s; sizes in MiB (2**20 B), GB/s = 1e9 B/s")
    if cfg.json_path:
        doc = {
            "bench": "transfer",
            "machine": machine_info(),
            "config": {k: v for k, v in asdict(cfg).items() if k != "json_path"},
            "timed": TIMED,
            "units": {
                "size_bytes": "bytes",
                "seconds": "median s",
                "gbps": "1e9 B/s",
                "ratio": "connector GB/s / raw GB/s of the same work",
            },
            "rows": [asdict(r) for r in rows],
            "roundtrip_4k": rt,
            "raw_store_split": split,
            "raw_retries": retries,
            "unmeasured": [
                {"size_bytes": r.size_bytes, "path": r.path, "reason": r.unmeasured}
                for r in rows
                if r.unmeasured
            ],
            "summary": summary(rows, rt),
            "store_keys_left": len(left),
            "total_seconds": total,
        }
        with open(cfg.json_path, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The staged device path through real Mooncake transports, on CPU.

Regions claim ``cuda:0`` but live in host memory and are copied by ``HostOps``
(the same contract as the CUDA copies): the payload is staged through a pinned
buffer on the producer, crosses a real p2p or store transport, and is copied
out of the consumer's staging buffer chunk by chunk. What only a GPU proves
(real device copies, CUDA event ordering, GPU-direct) is in ``tests/gpu``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from mooncake_diffusion.errors import DeadlineExceededError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transfer.chunks import plan
from mooncake_diffusion.transfer.staging import HostOps, Stager
from mooncake_diffusion.transfer.transports.p2p import P2PTransport
from mooncake_diffusion.transfer.transports.store import StoreTransport
from mooncake_diffusion.wire.schema import PayloadHandle

pytestmark = pytest.mark.integration

CASES = [("p2p", True), ("p2p", False), ("store", True)]


def _on_device(arr: np.ndarray, ready=None):
    spec, region = describe("latent", arr)
    return spec, dataclasses.replace(region, device="cuda:0", ready=ready)


@pytest.mark.parametrize(("mode", "same_host"), CASES)
def test_device_payload_is_staged_both_ways_chunk_by_chunk(mooncake_cluster, mode, same_host):
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    settings = dataclasses.replace(mooncake_cluster.settings, same_host=same_host)
    kind = P2PTransport if mode == "p2p" else StoreTransport
    prod, cons = kind(settings), kind(settings)
    ops = HostOps()
    for t in (prod, cons):  # the CPU stand-in for TorchCudaOps, same contract
        t._stager = Stager(lambda: False, lambda: False, "auto", lambda: ops)
    try:
        src = np.random.default_rng(3).integers(0, 255, (4, 3, 1000), dtype=np.uint8)
        produced = []
        spec, region = _on_device(src, ready=lambda: produced.append(1))
        chunks = plan([spec], 0, 2)
        payload_id = f"r1/latent/{mode}{same_host}"
        source = prod.prepare(payload_id, [region], "delete_on_consume", chunks)
        for c in range(2):
            prod.commit(payload_id, source, [region], "delete_on_consume", chunks, c)
        assert produced, "the producer copied before its stream was known to be done"
        handle = PayloadHandle(
            payload_id, "r1", "latent", mode, "delete_on_consume", (spec,), source,
            chunk_dim=0, num_chunks=2,
        )  # fmt: skip
        dst = np.zeros_like(src)
        _, dst_region = _on_device(dst)
        landed: list[int] = []
        seen: list[bool] = []

        def on_chunk(i: int) -> None:  # the chunk is in the destination when reported
            landed.append(i)
            half = dst.shape[0] // 2
            rows = slice(0, half) if i == 0 else slice(half, None)
            seen.append(bool(np.array_equal(dst[rows], src[rows])))

        path = cons.fetch(handle, [dst_region], chunks, time.monotonic() + 30, on_chunk)
        assert np.array_equal(dst, src)
        assert sorted(landed) == [0, 1] and all(seen)
        if mode == "p2p":
            assert path.startswith("p2p/") and path.endswith("|src=staged|dst=staged"), path
        else:
            assert path == "store|dst=staged"
        assert prod.registered()[2] == 0 and cons.registered() == (0, 0, 0)
    finally:
        prod.close()
        cons.close()
    assert prod.registered() == (0, 0, 0)
    assert_no_leaks(mooncake_cluster, baseline)


@pytest.mark.parametrize("host_too", [False, True], ids=["all staged", "one host region"])
def test_staging_buffer_of_a_broken_off_fetch_is_freed_when_its_hold_ends(
    mooncake_cluster, host_too
):
    """A p2p fetch broken off keeps its inbound staging buffer for the transport's
    ``late_write_s`` (the producer may still write into it), then frees it at the next
    fetch, not only at ``close()``. With every region staged, the late bytes can land
    only there: the fetch's own regions are not held (``may_write_late`` is False);
    with a host region written in place too, they are. ``late_write_s`` is 0.2 s here."""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    prod, cons = P2PTransport(mooncake_cluster.settings), P2PTransport(mooncake_cluster.settings)
    ops = HostOps()
    for t in (prod, cons):
        t._stager = Stager(lambda: False, lambda: False, "auto", lambda: ops)
    cons.late_write_s = 0.2
    try:
        srcs = [np.arange(2 * 4096, dtype=np.uint8).reshape(2, 4096)]
        if host_too:
            srcs.append(np.arange(2 * 512, dtype=np.int32).reshape(2, 512))
        described = [describe(f"t{i}", a) for i, a in enumerate(srcs)]
        specs = [spec for spec, _ in described]
        regions = [dataclasses.replace(described[0][1], device="cuda:0")]
        regions += [region for _, region in described[1:]]  # host memory, written in place
        chunks = plan(specs, 0, 2)

        def published(payload_id: str, ready: int) -> PayloadHandle:
            source = prod.prepare(payload_id, regions, "delete_on_consume", chunks)
            for c in range(ready):
                prod.commit(payload_id, source, regions, "delete_on_consume", chunks, c)
            return PayloadHandle(
                payload_id, "r1", "latent", "p2p", "delete_on_consume", tuple(specs), source,
                chunk_dim=0, num_chunks=2,
            )  # fmt: skip

        stalled = published("r1/latent/stalled", 1)  # chunk 1 never ready
        dsts = [np.zeros_like(a) for a in srcs]
        dst_regions = [describe(f"t{i}", a)[1] for i, a in enumerate(dsts)]
        dst_regions[0] = dataclasses.replace(dst_regions[0], device="cuda:0")
        deadline = time.monotonic() + 0.5
        with pytest.raises(DeadlineExceededError) as broke:
            cons.fetch(stalled, dst_regions, chunks, deadline, lambda i: None)
        assert cons.may_write_late(broke.value) is host_too
        [(until, kept)] = cons._late_staging
        assert until >= deadline + 0.2
        cons._free_late_staging(until - 0.001)  # what a fetch does first, just before
        assert cons._late_staging == [(until, kept)] and kept._buffer is not None
        time.sleep(max(until - time.monotonic(), 0) + 0.05)
        whole = published("r1/latent/whole", 2)
        cons.fetch(whole, dst_regions, chunks, time.monotonic() + 30, lambda i: None)
        assert all(np.array_equal(d, a) for d, a in zip(dsts, srcs, strict=True))
        assert cons._late_staging == [] and kept._buffer is None  # its hold ended: freed
        prod.discard(stalled)
    finally:
        prod.close()
        cons.close()
    assert prod.registered() == (0, 0, 0) and cons.registered() == (0, 0, 0)
    assert_no_leaks(mooncake_cluster, baseline)


@pytest.mark.parametrize("wait", ["returns", "fails", "interrupted"])
def test_a_fetch_broken_off_inside_a_copy_out_of_staging_holds_its_regions_until_settled(
    mooncake_cluster, wait
):
    """With every region staged a broken-off fetch holds only the staging buffer.
    Broken off inside a copy from that buffer into a region (a CUDA copy may be
    queued: it ends only when ``receive`` returns), the fetch waits for the copies
    it queued; only if that wait fails too may the region still be written, and
    ``may_write_late`` is True. The copy fails here (an interrupt or a CUDA error
    in its place); the wait returns, fails, or is itself interrupted (then the
    interrupt is what the caller gets, marked, and the staging buffer is held)."""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    prod, cons = P2PTransport(mooncake_cluster.settings), P2PTransport(mooncake_cluster.settings)
    flushes: list[str] = []

    class FailingCopyIn(HostOps):
        def copy_in(self, dst, offset, host, at, n):
            raise RuntimeError("copy into the device failed")

        def flush(self) -> None:
            flushes.append(wait)
            if wait == "fails":
                raise RuntimeError("the device is in an error state")
            if wait == "interrupted":
                raise KeyboardInterrupt

    prod._stager = Stager(lambda: False, lambda: False, "auto", HostOps)
    cons._stager = Stager(lambda: False, lambda: False, "auto", FailingCopyIn)
    try:
        src = np.arange(2 * 4096, dtype=np.uint8).reshape(2, 4096)
        spec, region = _on_device(src)
        chunks = plan([spec], 0, 2)
        source = prod.prepare("r1/latent/x", [region], "delete_on_consume", chunks)
        for c in range(2):
            prod.commit("r1/latent/x", source, [region], "delete_on_consume", chunks, c)
        handle = PayloadHandle(
            "r1/latent/x", "r1", "latent", "p2p", "delete_on_consume", (spec,), source,
            chunk_dim=0, num_chunks=2,
        )  # fmt: skip
        _, dst_region = _on_device(np.zeros_like(src))
        raised = KeyboardInterrupt if wait == "interrupted" else RuntimeError
        with pytest.raises(raised) as broke:
            cons.fetch(handle, [dst_region], chunks, time.monotonic() + 30, lambda i: None)
        if raised is RuntimeError:
            assert "copy into the device failed" in str(broke.value)
        assert flushes == [wait]
        assert cons.may_write_late(broke.value) is (wait != "returns")
        assert len(cons._late_staging) == 1  # the producer may still write into it
    finally:
        prod.close()
        cons.close()
    assert prod.registered() == (0, 0, 0) and cons.registered() == (0, 0, 0)
    assert_no_leaks(mooncake_cluster, baseline)

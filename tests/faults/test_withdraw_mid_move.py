"""A p2p payload withdrawn while the producer is writing one of its chunks.

A release, a cleanup or a TTL may withdraw a payload whose consumer is being served.
Its owner may free or reuse the memory once the release returned, so the producer
must (1) keep the registrations and the staging buffer the running write reads until
that write ends, without making the release wait for it, and (2) not report a chunk
read across the withdrawal as landed: the consumer gets ``PayloadGoneError`` and no
chunk. The write is held inside the producer's ``_move`` (wrapped on the instance)
until the withdrawal has returned, so the withdrawal always lands mid-write.

Device payloads use ``HostOps`` (host memory that claims ``cuda:0``, the same contract
as the CUDA copies) because this machine has no GPU; the transports, the side channel
and the Mooncake engines are real.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from mooncake_diffusion.chunks import plan
from mooncake_diffusion.errors import PayloadGoneError
from mooncake_diffusion.schema import PayloadHandle
from mooncake_diffusion.staging import HostOps, Stager
from mooncake_diffusion.tensors import describe
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transports.p2p import P2PTransport

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("memory", "same_host"), [("host", False), ("staged", True), ("staged", False)]
)
def test_withdrawal_mid_write_keeps_memory_until_it_ends_and_reports_no_chunk(
    mooncake_cluster, memory, same_host
):
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    settings = dataclasses.replace(mooncake_cluster.settings, same_host=same_host)
    prod, cons = P2PTransport(settings), P2PTransport(settings)
    staged = memory == "staged"
    if staged:
        ops = HostOps()
        for t in (prod, cons):
            t._stager = Stager(lambda: False, lambda: False, "auto", lambda: ops)
    entered, go = threading.Event(), threading.Event()
    during: dict[str, object] = {}
    real_move = prod._move

    def held_move(req, held, segments):  # chunk 0's write, held until the withdrawal
        entered.set()
        assert go.wait(30), "the test never let the write go"
        during["registered"] = prod.registered()
        during["staging alive"] = held.staged is not None and held.staged._buffer is not None
        return real_move(req, held, segments)

    prod._move = held_move
    try:
        src = np.random.default_rng(5).integers(0, 255, (4, 2, 4096), dtype=np.uint8)
        spec, region = describe("latent", src)
        if staged:
            region = dataclasses.replace(region, device="cuda:0")
        chunks = plan([spec], 0, 2)
        payload_id = f"r1/latent/{memory}{same_host}"
        source = prod.prepare(payload_id, [region], "delete_on_consume", chunks)
        for c in range(2):
            prod.commit(payload_id, source, [region], "delete_on_consume", chunks, c)
        handle = PayloadHandle(
            payload_id, "r1", "latent", "p2p", "delete_on_consume", (spec,), source,
            chunk_dim=0, num_chunks=2,
        )  # fmt: skip
        dst = np.zeros_like(src)
        _, dst_region = describe("latent", dst)
        if staged:
            dst_region = dataclasses.replace(dst_region, device="cuda:0")
        landed: list[int] = []
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                cons.fetch(handle, [dst_region], chunks, time.monotonic() + 30, landed.append)
            except BaseException as e:
                errors.append(e)

        consumer = threading.Thread(target=consume)
        consumer.start()
        assert entered.wait(30), "the producer never started the write"
        before = prod.registered()
        assert before[0] >= 1
        t0 = time.monotonic()
        prod.discard(handle)  # the owner's release, while chunk 0 is being written
        waited = time.monotonic() - t0
        go.set()
        consumer.join(60)
        assert not consumer.is_alive()
        assert waited < 5, f"the withdrawal waited {waited:.1f} s for the write"
        assert during["registered"] == before, "registrations let go under a running write"
        if staged:
            assert during["staging alive"], "the staging buffer was freed under a running write"
        assert landed == [], f"chunks {landed} were reported landed across the withdrawal"
        assert [type(e) for e in errors] == [PayloadGoneError], errors
        assert "withdrawn" in str(errors[0])
        assert not prod.holds(payload_id)
        assert prod.registered() == (0, 0, 0), "the write ended but its memory was kept"
    finally:
        go.set()
        prod.close()
        cons.close()
    assert prod.registered() == (0, 0, 0) and cons.registered() == (0, 0, 0)
    assert_no_leaks(mooncake_cluster, baseline)

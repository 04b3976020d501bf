"""A p2p payload withdrawn while the producer is writing one of its chunks.

A release, a cleanup or a TTL may withdraw a payload whose consumer is being served.
Its owner may overwrite the memory once the release returned, so the producer must
(1) keep the registrations the running writes read (the payload's, or its staging
buffer's) until the last of them ends, without making the release wait for them,
and (2) not report a chunk read across the withdrawal as landed: each consumer gets
``PayloadGoneError`` and no chunk. Every write is held inside the producer's
``_move`` (wrapped on the instance) until the withdrawal has returned, so the
withdrawal always lands mid-write; with a shared payload, two consumers' writes are
held and let go one at a time.

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
    ("memory", "same_host", "consumers"),
    [("host", False, 1), ("staged", True, 1), ("staged", False, 1), ("host", False, 2)],
)
def test_withdrawal_mid_write_keeps_memory_until_the_writes_end_and_reports_no_chunk(
    mooncake_cluster, memory, same_host, consumers
):
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    settings = dataclasses.replace(mooncake_cluster.settings, same_host=same_host)
    prod, cons = P2PTransport(settings), P2PTransport(settings)
    staged = memory == "staged"
    if staged:
        ops = HostOps()
        for t in (prod, cons):
            t._stager = Stager(lambda: False, lambda: False, "auto", lambda: ops)
    gates = [threading.Event() for _ in range(consumers)]
    entered = threading.Condition()
    moves: list[int] = []  # the writes that entered, in order
    during: list[tuple[int, int, int]] = []  # the producer's registrations as each ran
    real_move = prod._move

    def held_move(req, held, segments):  # a write of chunk 0, held until its gate opens
        with entered:
            n = len(moves)
            moves.append(n)
            entered.notify_all()
        assert gates[n].wait(30), "the test never let the write go"
        during.append(prod.registered())
        return real_move(req, held, segments)

    prod._move = held_move
    lease = "delete_on_consume" if consumers == 1 else "shared"
    try:
        src = np.random.default_rng(5).integers(0, 255, (4, 2, 4096), dtype=np.uint8)
        spec, region = describe("latent", src)
        if staged:
            region = dataclasses.replace(region, device="cuda:0")
        chunks = plan([spec], 0, 2)
        payload_id = f"r1/latent/{memory}{same_host}{consumers}"
        source = prod.prepare(payload_id, [region], lease, chunks)
        for c in range(2):
            prod.commit(payload_id, source, [region], lease, chunks, c)
        handle = PayloadHandle(
            payload_id, "r1", "latent", "p2p", lease, (spec,), source,
            chunk_dim=0, num_chunks=2,
        )  # fmt: skip
        landed: list[int] = []
        errors: list[BaseException] = []

        def consume() -> None:
            dst = np.zeros_like(src)
            _, dst_region = describe("latent", dst)
            if staged:
                dst_region = dataclasses.replace(dst_region, device="cuda:0")
            try:
                cons.fetch(handle, [dst_region], chunks, time.monotonic() + 30, landed.append)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=consume) for _ in range(consumers)]
        for t in threads:
            t.start()
        with entered:
            assert entered.wait_for(lambda: len(moves) == consumers, 30), "writes never began"
        before = prod.registered()
        assert before[0] >= 1
        t0 = time.monotonic()
        prod.discard(handle)  # the owner's release, while chunk 0 is being written
        waited = time.monotonic() - t0
        assert waited < 5, f"the withdrawal waited {waited:.1f} s for the writes"
        for n, gate in enumerate(gates):
            gate.set()
            deadline = time.monotonic() + 30
            while len(errors) < n + 1:  # this consumer has its answer: its write ended
                assert time.monotonic() < deadline, "a consumer never got its answer"
                time.sleep(0.01)
            if n + 1 < consumers:
                assert prod.registered() == before, "let go while another write still reads"
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert during == [before] * consumers, "registrations let go under a running write"
        assert landed == [], f"chunks {landed} were reported landed across the withdrawal"
        assert [type(e) for e in errors] == [PayloadGoneError] * consumers, errors
        assert all("withdrawn" in str(e) for e in errors), errors
        assert not prod.holds(payload_id)
        assert prod.registered() == (0, 0, 0), "the writes ended but their memory was kept"
    finally:
        for gate in gates:
            gate.set()
        prod.close()
        cons.close()
    assert prod.registered() == (0, 0, 0) and cons.registered() == (0, 0, 0)
    assert_no_leaks(mooncake_cluster, baseline)

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

from mooncake_diffusion.errors import PayloadGoneError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transfer.chunks import plan
from mooncake_diffusion.transfer.staging import HostOps, Stager
from mooncake_diffusion.transfer.transports.p2p import P2PTransport
from mooncake_diffusion.wire.schema import PayloadHandle

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


def test_withdrawal_mid_commit_keeps_the_staging_buffer_until_the_commit_ends(mooncake_cluster):
    """A device payload's ``commit`` copies its chunk into the staging buffer the engine
    reads; a TTL or cleanup withdrawing the payload meanwhile must not free that
    buffer under the copy (it did: the commit then failed with a ``TypeError``). The
    copy is held inside ``Staged.send`` (wrapped on the instance) until the
    withdrawal returned; the commit then ends without error and lets the memory go."""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    prod = P2PTransport(mooncake_cluster.settings)
    ops = HostOps()
    prod._stager = Stager(lambda: False, lambda: False, "auto", lambda: ops)
    gate, entered = threading.Event(), threading.Event()
    try:
        src = np.random.default_rng(6).integers(0, 255, (4, 2, 4096), dtype=np.uint8)
        spec, region = describe("latent", src)
        region = dataclasses.replace(region, device="cuda:0")
        chunks = plan([spec], 0, 2)
        payload_id = "r1/latent/commit"
        source = prod.prepare(payload_id, [region], "delete_on_consume", chunks)
        staged = prod._held[payload_id].staged
        assert staged is not None
        real_send = staged.send

        def held_send(segments):  # the chunk's copy, held until the gate opens
            entered.set()
            assert gate.wait(30), "the test never let the copy go"
            real_send(segments)

        staged.send = held_send  # type: ignore[method-assign]
        errors: list[BaseException] = []

        def commit() -> None:
            try:
                prod.commit(payload_id, source, [region], "delete_on_consume", chunks, 0)
            except BaseException as e:
                errors.append(e)

        committer = threading.Thread(target=commit)
        committer.start()
        assert entered.wait(30), "the commit never began its copy"
        before = prod.registered()
        assert before[0] >= 1
        handle = PayloadHandle(
            payload_id, "r1", "latent", "p2p", "delete_on_consume", (spec,), source,
            chunk_dim=0, num_chunks=2,
        )  # fmt: skip
        t0 = time.monotonic()
        prod.discard(handle)  # a TTL's withdrawal, while chunk 0 is being staged
        assert time.monotonic() - t0 < 5, "the withdrawal waited for the commit"
        assert prod.registered() == before, "the staging buffer was let go under the copy"
        gate.set()
        committer.join(60)
        assert not committer.is_alive()
        assert errors == [], errors
        assert not prod.holds(payload_id)
        assert prod.registered() == (0, 0, 0), "the commit ended but its memory was kept"
        # a withdrawn payload's later commit does nothing
        prod.commit(payload_id, source, [region], "delete_on_consume", chunks, 1)
    finally:
        gate.set()
        prod.close()
    assert prod.registered() == (0, 0, 0)
    assert_no_leaks(mooncake_cluster, baseline)

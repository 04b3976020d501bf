"""Spill instead of fail, on real processes (master, store host, client): a burst
of soft-pinned 8 MiB objects three times the 64 MiB pool, with the store host
spilling to disk (``_mooncake/spill.py``) and without, side by side. With spill
every object reads back intact; without, DRAM keeps only what fits. Hard-pinned
objects never spill (the stated rule): past the pool they fail as before."""

from __future__ import annotations

import time

import pytest
import torch

from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import StoreFullError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration

MIB = 1 << 20
POOL = 64 * MIB
OBJ = 8 * MIB
BURST = 3 * POOL // OBJ


def _burst(cluster: LocalCluster, pin: str, count: int, window_s: float) -> tuple[int, int]:
    """Put ``count`` objects one by one, each retried while the pool is full for up
    to ``window_s`` (as the keyed handoff's put does), then read each back:
    (put, read intact)."""
    assert cluster.settings is not None
    client = StoreClient(cluster.settings)
    src = torch.zeros(OBJ, dtype=torch.uint8)
    dst = torch.zeros(OBJ, dtype=torch.uint8)
    for t in (src, dst):
        client.regs.pin(describe("b", t)[1])
    keys = [f"burst-{pin}-{i}" for i in range(count)]
    put = intact = 0
    try:
        for i, key in enumerate(keys):
            src.fill_(i + 1)
            if not _put_within(client, key, src, pin, time.monotonic() + window_s):
                break
            put += 1
        for i, key in enumerate(keys[:put]):
            dst.zero_()
            if client.get_many([key], [[dst.data_ptr()]], [[OBJ]]) == [True]:
                intact += bool((dst == i + 1).all())
        client.remove_many(keys[:put])
    finally:
        for t in (src, dst):
            client.regs.unpin(describe("b", t)[1])
        client.close()
    return put, intact


def _put_within(client: StoreClient, key: str, src: torch.Tensor, pin: str, end: float) -> bool:
    while True:
        try:
            client.put_many([key], [[src.data_ptr()]], [[OBJ]], pin=pin)
            return True
        except StoreFullError:
            if time.monotonic() > end:
                return False
            time.sleep(0.1)


def test_a_burst_larger_than_the_pool_spills_instead_of_failing(tmp_path):
    threads = thread_names()
    with LocalCluster(POOL, spill_dir=str(tmp_path / "spill")) as spilling:
        put, intact = _burst(spilling, "soft", BURST, 60.0)
        assert (put, intact) == (BURST, BURST)
        assert any((tmp_path / "spill").rglob("*")), "nothing was written to disk"
        # hard-pinned objects never leave DRAM: past the pool they fail as before
        hard_put, _ = _burst(spilling, "hard", BURST, 3.0)
        assert hard_put < BURST
        assert spilling.keys() == []
    with LocalCluster(POOL) as dram_only:
        put, intact = _burst(dram_only, "soft", BURST, 60.0)
        assert put == BURST and intact < BURST  # evicted objects are gone
        assert dram_only.keys() == []
    assert_no_leaks(None, threads)

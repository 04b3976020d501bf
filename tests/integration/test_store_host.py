"""The store host's ``--prefault``: its pool is resident before it says ready, and a
pool faulted in that way stores and serves bytes unchanged. Real mooncake_master and
store host processes (private clusters: the session's is not prefaulted); the pool's
residency is read from the store host's /proc status."""

from __future__ import annotations

import mmap

import pytest

from helpers import make_tensor, same_bytes
from mooncake_diffusion import DiffusionConnector, StagePayload
from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion.testing import assert_no_leaks, thread_names
from mooncake_diffusion.transfer import store_host

pytestmark = pytest.mark.integration

POOL = 512 << 20  # well above the store host's own ~100 MiB


def _resident(pid: int) -> int:
    """Bytes of ``pid``'s memory resident right now."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_prefault_faults_in_only_mappings_made_since_it_looked():
    """The helper itself, on this process: an untouched anonymous mapping made after
    the snapshot is faulted in, and its contents stay zero."""
    before = store_host._anonymous_mappings(8 << 20)
    mem = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # untouched
    try:
        faulted = store_host.prefault(before, 16 << 20)
        assert faulted >= 16 << 20
        assert mem[:4096] == bytes(4096) and mem[-4096:] == bytes(4096)
        assert store_host.prefault(store_host._anonymous_mappings(8 << 20), 8 << 20) == 0
    finally:
        mem.close()


@pytest.mark.parametrize("prefault", [True, False], ids=["prefault", "no-prefault"])
def test_a_prefaulted_pool_is_resident_and_serves_bytes_unchanged(prefault):
    threads = thread_names()
    with LocalCluster(pool_bytes=POOL, prefault=prefault) as c:
        resident = _resident(c._store_host.pid)
        if prefault:
            assert c.prefaulted_bytes >= POOL
            assert resident >= POOL
        else:  # the control: without it the pool is not resident, so the check can fail
            assert c.prefaulted_bytes == 0
            assert resident < POOL // 2
        x = make_tensor("bfloat16", (1, 16, 8, 64, 64), 41)  # 1 MiB
        with (
            DiffusionConnector("denoise", "store", c.settings) as prod,
            DiffusionConnector("decode", "store", c.settings) as cons,
        ):
            pub = prod.publish(StagePayload("pf", "latent", tensor=x))
            with cons.consume(pub.encode()) as got:
                assert same_bytes(got.tensor, x)
            pub.release()
        assert_no_leaks(c, threads)

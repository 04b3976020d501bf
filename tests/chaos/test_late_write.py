"""A p2p producer cut off mid-write finishes that write when its link comes back,
long after the consumer gave it up: the consumer must not have handed that memory
to another payload meanwhile.

Real Transfer Engines across network namespaces (``hosts.py``): the producer
(``late_producer.py``) has written chunk 0 of payload A when its host's link goes
down; only then does it ready the other chunks, so its write of chunk 1 is under
way inside the partition every time (never raced). The consumer (this process, the
client host) gives A up with ``PeerGoneError``. The partition lasts ``CUT_S``, longer
than the 10 s the consumer once held such memory back for; meanwhile the consumer
receives payload B (as big as its whole receive pool) from a producer that is
reachable. Then the link comes back and the cut-off write lands in A's memory: B must
still be bitwise its producer's (before the fix it was in the same memory)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from hosts import Hosts, available
from late_producer import SEED, SHAPE

from helpers import same_bytes
from mooncake_diffusion.errors import PeerGoneError
from mooncake_diffusion.handoff.demo import make_tensor
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.testing import thread_names
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import StagePayload

pytestmark = pytest.mark.chaos

HERE = Path(__file__).resolve().parent

CUT_S = 12.0  # the partition, from the give-up on: past the 10 s of the old hold
LAND_S = 120.0  # how long the healed write may take to land (a busy machine)
NBYTES = SHAPE[0] * SHAPE[1] * 4


def _fds() -> dict[str, str]:
    """This process's open fds and what each one is."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory's own fd, closed by now
    return out


def test_late_write_never_lands_in_reused_memory(tmp_path):
    why = available()
    if why is not None:
        pytest.skip(f"chaos tier not run: {why}")
    go = tmp_path / "go"
    with Hosts(["prod"], str(tmp_path)) as net:
        # the first Transfer Engine of a process opens what it keeps for the process's
        # life (cgroup CPU files, an event loop): made before the baseline
        once = DiffusionConnector("decode", "p2p", MooncakeSettings(local_hostname=net.client_ip))
        once.register(spare := torch.empty(16))
        once.unregister(spare)
        once.close()
        threads, fds = thread_names(), _fds()
        env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, str(HERE / "late_producer.py"), net.ip("prod"), str(go)]
        p = net.spawn("prod", argv, env)
        handle = bytes.fromhex(p.wait_for("handle ", 120).split("handle ", 1)[1].split()[0])
        here = MooncakeSettings(local_hostname=net.client_ip, same_host=False, peer_timeout_s=1.0)
        cons = DiffusionConnector("decode", "p2p", here, receive_pool_bytes=NBYTES)
        near = DiffusionConnector("encode", "p2p", here)  # a producer nothing cuts off
        try:
            want_a = make_tensor("float32", SHAPE, SEED)
            got_a = cons.consume(handle, timeout=300)  # far beyond the peer timeout
            first = got_a.chunk(0).tensor
            assert same_bytes(first, want_a[0:1])
            # A's whole destination, chunk 0 on: what the late write will reach
            dest_a = torch.empty(0, dtype=torch.float32).set_(
                first.untyped_storage(), first.storage_offset(), SHAPE
            )
            net.partition("prod")
            go.touch()
            p.wait_for("readied", 60)  # chunk 1 is being written into the partition
            with pytest.raises(PeerGoneError):
                got_a.wait()
            got_a.release()
            gave_up = time.monotonic()
            stats = cons.stats()
            assert stats.pool_bytes_quarantined == NBYTES and stats.pool_bytes_in_use == 0

            time.sleep(max(0.0, gave_up + CUT_S - time.monotonic()))
            want_b = make_tensor("float32", SHAPE, SEED + 1)
            pub_b = near.publish(StagePayload("b", "latent", tensor=want_b))
            got_b = cons.consume(pub_b.handle, timeout=60)
            b = got_b.tensor
            assert same_bytes(b, want_b)

            net.heal("prod")
            deadline = time.monotonic() + LAND_S
            rest = want_a[1:2]  # chunk 1: the write cut off
            while not same_bytes(dest_a[1:2], rest):
                assert time.monotonic() < deadline, "the cut-off write never landed"
                time.sleep(0.1)
            # it landed where A was; B is untouched (it is elsewhere)
            intact = same_bytes(b, want_b)
            assert intact, "a late write of A's landed in B"
            got_b.release()
            pub_b.release()
            stats = cons.stats()
            assert stats.pool_bytes_quarantined == NBYTES  # A's memory: still held
            assert stats.pool_bytes_in_use == 0 and stats.temporary_registrations == 0
        finally:
            near.close()
            cons.close()
            p.stop()
    assert not net.leftovers()
    deadline = time.monotonic() + 10
    while (thread_names() - threads or _fds() != fds) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert thread_names() - threads == set()
    assert _fds() == fds, set(_fds().items()) ^ set(fds.items())

"""Direct store reads against a real ``mooncake_master`` and store host (separate
processes, loopback TCP): a pure ``StoreClient`` reads objects of
``DIRECT_MIN_BYTES`` or more with its own polled Transfer Engine, from the replica
the master names, instead of Mooncake's get (whose wait spins a core). The bytes and
results are those of Mooncake's get; what a direct read cannot take is handed to
Mooncake's get, whose answer stands; a read that ended past the lease it relies on
is redone. Each test runs both ways a direct read goes: out of the store host on
this host (``process_vm_readv``, ``same_host`` on) and over the network (the
reader's Transfer Engine, ``same_host`` off)."""

from __future__ import annotations

import dataclasses
import errno

import pytest
import torch

from mooncake_diffusion._mooncake import store as store_module
from mooncake_diffusion._mooncake.store import DIRECT_MIN_BYTES, StoreClient
from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture(params=["local", "net"])
def clients(mooncake_cluster, request):
    """A producer, a direct reader (reading out of the store host on this host, or over
    the network) and a reader with direct reads off, each with a pinned 2 MiB buffer:
    (producer, direct, plain, {client: buffer})."""
    threads = thread_names()
    s = mooncake_cluster.settings
    made = [
        StoreClient(s),
        StoreClient(dataclasses.replace(s, same_host=request.param == "local")),
        StoreClient(dataclasses.replace(s, store_direct_reads=False)),
    ]
    bufs = {}
    for c in made:
        buf = torch.zeros(2 * MIB, dtype=torch.uint8)
        c.regs.pin(describe("b", buf)[1])
        bufs[c] = buf
    yield (*made, bufs)
    for c in made:
        c.regs.unpin(describe("b", bufs[c])[1])
        c.close()
        assert c.regs.count == 0
    assert_no_leaks(mooncake_cluster, threads)


def _put(producer: StoreClient, buf: torch.Tensor, key: str, n: int) -> torch.Tensor:
    buf[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
    producer.put_many([key], [[buf.data_ptr()]], [[n]], pin="none")
    return buf[:n].clone()


def test_a_direct_read_scatters_the_same_bytes_mooncakes_get_does(clients) -> None:
    producer, direct, plain, bufs = clients
    n = MIB + 12345
    assert n >= DIRECT_MIN_BYTES
    want = _put(producer, bufs[producer], "direct/a", n)
    cut = 300_001  # two destination ranges, the second at an odd offset
    for c in (direct, plain):
        buf = bufs[c]
        ptrs = [buf.data_ptr() + 7, buf.data_ptr() + MIB]
        assert c.get_many(["direct/a"], [ptrs], [[cut, n - cut]]) == [True]
        assert torch.equal(buf[7 : 7 + cut], want[:cut])
        assert torch.equal(buf[MIB : MIB + n - cut], want[cut:])
    assert (direct.direct_reads, direct.direct_fallbacks) == (1, 0)
    assert direct.local_reads == (1 if direct._same_host else 0)
    assert plain.direct_reads == 0
    # a small read goes through Mooncake's get: no lookup of its own to pay for
    small = _put(producer, bufs[producer], "direct/small", 4096)
    bufs[direct].zero_()
    assert direct.get_many(["direct/small"], [[bufs[direct].data_ptr()]], [[4096]]) == [True]
    assert torch.equal(bufs[direct][:4096], small)
    assert direct.direct_reads == 1
    producer.remove_many(["direct/small"])
    producer.remove_many(["direct/a"])


def test_absent_keys_read_as_absent_with_or_without_a_present_one(clients) -> None:
    producer, direct, _plain, bufs = clients
    n = MIB
    _put(producer, bufs[producer], "direct/here", n)
    ptr = bufs[direct].data_ptr()
    # one present key: the lookup answered, so the absent one is absent, no fallback
    found = direct.get_many(["direct/here", "direct/none"], [[ptr], [ptr + n]], [[n], [n]])
    assert found == [True, False]
    assert (direct.direct_reads, direct.direct_fallbacks) == (1, 0)
    # every key absent: an empty lookup may be a failed one, so Mooncake's get decides
    assert direct.get_many(["direct/none"], [[ptr]], [[n]]) == [False]
    assert direct.direct_fallbacks == 1
    producer.remove_many(["direct/here"])


def test_a_size_mismatch_is_mooncakes_get_error(clients) -> None:
    producer, direct, plain, bufs = clients
    _put(producer, bufs[producer], "direct/sized", MIB)
    errors = []
    for c in (direct, plain):
        with pytest.raises(MooncakeDiffusionError) as e:
            c.get_many(["direct/sized"], [[bufs[c].data_ptr()]], [[MIB + 4096]])
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]
    assert direct.direct_fallbacks == 1 and direct.direct_reads == 0
    producer.remove_many(["direct/sized"])


def test_a_read_that_outlived_its_lease_is_redone(clients, monkeypatch) -> None:
    """The first try ends past the lease it relies on (``lease_s`` set below any read's
    time), the retry within it: the key is read twice, once redone. A real short lease
    is provoked in ``tests/faults/test_store_transients.py``."""
    producer, direct, _plain, bufs = clients
    n = MIB
    want = _put(producer, bufs[producer], "direct/late", n)
    reader = direct._native.reader
    assert reader is not None
    # the call that does the read: one read each (local), or a list of them (net)
    owner, name = (direct, "_read_local") if direct._same_host else (reader, "read_many")
    real = getattr(owner, name)
    tries = []

    def late_first(reads):
        tries.append(1 if direct._same_host else len(reads))
        direct.lease_s = 1e-9 if len(tries) == 1 else 60.0
        return real(reads)

    monkeypatch.setattr(owner, name, late_first)
    buf = bufs[direct]
    assert direct.get_many(["direct/late"], [[buf.data_ptr()]], [[n]]) == [True]
    assert torch.equal(buf[:n], want)
    assert tries == [1, 1] and direct.retries == 1
    assert direct.local_reads == (2 if direct._same_host else 0)
    producer.remove_many(["direct/late"])


def test_a_local_read_the_kernel_refuses_goes_over_the_network(
    mooncake_cluster, monkeypatch
) -> None:
    """``process_vm_readv`` failing: the read goes through the Transfer Engine with the
    same bytes. A bad address (EFAULT) affects that read only; a refusal (EPERM, as
    under a ptrace policy that forbids it) keeps that store host on the network from
    then on. Before that, the store host the client found on this host is the
    cluster's own process."""
    threads = thread_names()
    s = mooncake_cluster.settings
    producer, direct = StoreClient(s), StoreClient(s)
    bufs = {c: torch.zeros(2 * MIB, dtype=torch.uint8) for c in (producer, direct)}
    try:
        for c, buf in bufs.items():
            c.regs.pin(describe("b", buf)[1])
        want = _put(producer, bufs[producer], "direct/refused", MIB)
        ptr = bufs[direct].data_ptr()
        assert direct.get_many(["direct/refused"], [[ptr]], [[MIB]]) == [True]
        assert direct.local_reads == 1
        assert list(direct._store_hosts.values()) == [mooncake_cluster._store_host.pid]
        answers = [errno.EFAULT, errno.EPERM]  # one bad address, then a refusal
        calls = []

        def failing(pid, parts):
            calls.append(pid)
            code = answers.pop(0)
            raise OSError(code, f"process_vm_readv: {errno.errorcode[code]}")

        monkeypatch.setattr(store_module, "vm_read", failing)
        for _ in range(3):
            bufs[direct].zero_()
            assert direct.get_many(["direct/refused"], [[ptr]], [[MIB]]) == [True]
            assert torch.equal(bufs[direct][:MIB], want)
        # EFAULT sent only its read over the network; EPERM marked the endpoint, so
        # the third read did not try
        assert len(calls) == 2 and answers == []
        assert list(direct._store_hosts.values()) == [None]
        assert (direct.direct_reads, direct.local_reads, direct.direct_fallbacks) == (4, 1, 0)
        producer.remove_many(["direct/refused"])
    finally:
        for c, buf in bufs.items():
            c.regs.unpin(describe("b", buf)[1])
            c.close()
    assert_no_leaks(mooncake_cluster, threads)

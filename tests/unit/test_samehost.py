import ctypes
import errno
import os
import socket

import pytest
import torch

from mooncake_diffusion.memory.samehost import (
    PeerPools,
    SharedPool,
    host_identity,
    listener_pid,
    vm_read,
    vm_write,
)

pytestmark = pytest.mark.unit


def test_a_mapped_shared_pool_is_the_same_memory():
    pool = SharedPool(1 << 16)
    peers = PeerPools()
    try:
        base = peers.map(os.getpid(), pool.fd, pool.token, pool.nbytes)
        src = torch.arange(256, dtype=torch.uint8)
        ctypes.memmove(base + 100, src.data_ptr(), 256)
        assert torch.equal(pool.tensor[100:356], src)
        assert peers.map(os.getpid(), pool.fd, pool.token, pool.nbytes) == base  # cached
        with pytest.raises(OSError):
            peers.map(os.getpid(), pool.fd, "another-token", pool.nbytes * 2)  # too large
    finally:
        peers.close()
        pool.close()


def test_vm_write_copies_every_part_and_reports_refusal():
    src = torch.arange(64, dtype=torch.int64)
    dst = torch.zeros(64, dtype=torch.int64)
    vm_write(
        os.getpid(),
        [(src.data_ptr(), dst.data_ptr(), 256), (src.data_ptr() + 256, dst.data_ptr() + 256, 256)],
    )
    assert torch.equal(src, dst)
    with pytest.raises(OSError):
        vm_write(2**22 + 12345, [(src.data_ptr(), dst.data_ptr(), 8)])  # no such process


def test_host_identity_is_stable_and_names_the_boot():
    assert host_identity() == host_identity() and "/" in host_identity()


def test_vm_read_copies_every_part_out_and_reports_a_missing_process():
    src = torch.arange(64, dtype=torch.int64)
    dst = torch.zeros(64, dtype=torch.int64)
    # (local, remote, length): the remote side is read, the local one written
    vm_read(os.getpid(), [(dst.data_ptr() + 256, src.data_ptr() + 256, 256)])
    assert torch.equal(dst[32:], src[32:]) and not dst[:32].any()
    with pytest.raises(OSError) as e:
        vm_read(2**22 + 12345, [(dst.data_ptr(), src.data_ptr(), 8)])  # no such process
    assert e.value.errno == errno.ESRCH


def test_listener_pid_finds_the_process_listening_on_a_port_and_only_while_it_does():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listener_pid(port) is None  # bound, not listening
        s.listen()
        assert listener_pid(port) == os.getpid()
    assert listener_pid(port) is None

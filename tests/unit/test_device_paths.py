"""Device paths on CPU: the choice of path, the staging plan, and the staging
steps run with ``HostOps`` (regions that claim a device but live in host memory)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.memory.device import (
    choose_path,
    describe_paths,
    nic_reaches_gpu,
    plan_staging,
)
from mooncake_diffusion.memory.tensors import Region, describe
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.chunks import Segment
from mooncake_diffusion.transfer.staging import HostOps, Stager

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("device", "cuda_build", "nic_gpu", "force", "want"),
    [
        ("cpu", True, True, "auto", "host"),
        ("cpu", False, False, "staged", "host"),
        ("cuda:0", True, True, "auto", "gpu-direct"),
        ("cuda:0", True, False, "auto", "staged"),  # TCP, or no peer-memory module
        ("cuda:0", False, True, "auto", "staged"),  # CPU build of Mooncake
        ("cuda:1", True, True, "staged", "staged"),
        ("cuda:0", True, False, "gpu-direct", "gpu-direct"),
    ],
)
def test_choose_path(device, cuda_build, nic_gpu, force, want):
    assert choose_path(device, cuda_build=cuda_build, nic_gpu=nic_gpu, force=force) == want


def test_forcing_gpu_direct_without_a_cuda_build_says_what_to_install():
    with pytest.raises(ConfigError, match=r"mooncake-diffusion\[cuda13\]"):
        choose_path("cuda:0", cuda_build=False, nic_gpu=True, force="gpu-direct")
    with pytest.raises(ConfigError, match="gpu_path"):
        choose_path("cuda:0", cuda_build=True, nic_gpu=True, force="fast")


def test_settings_reject_an_unknown_gpu_path(monkeypatch):
    with pytest.raises(ConfigError, match="gpu_path"):
        MooncakeSettings(gpu_path="fast")
    monkeypatch.setenv("MOONCAKE_DIFFUSION_GPU_PATH", "Staged")
    assert MooncakeSettings.from_env().gpu_path == "staged"


def test_nic_reaches_gpu_only_over_rdma_with_peer_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    present, absent = [str(tmp_path)], [str(tmp_path / "no")]
    assert nic_reaches_gpu("rdma", roots=present)
    assert not nic_reaches_gpu("rdma", roots=absent)
    assert not nic_reaches_gpu("tcp", roots=present)
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert not nic_reaches_gpu("rdma", roots=present)


def test_plan_staging_aligns_each_region_and_skips_empty_ones():
    assert plan_staging([10, 0, 4096, 1], align=4096) == ([0, 4096, 4096, 8192], 12288)
    assert plan_staging([]) == ([], 0)
    with pytest.raises(ValueError, match="power of two"):
        plan_staging([1], align=3)
    with pytest.raises(ValueError, match="negative"):
        plan_staging([-1])


def test_describe_paths_leaves_host_transfers_unmarked():
    assert describe_paths(["host", "host"]) == ""
    assert describe_paths(["staged", "host", "staged"]) == "host+staged"
    assert describe_paths(["gpu-direct"]) == "gpu-direct"


def _device_region(arr: np.ndarray, ready=None) -> Region:
    return dataclasses.replace(describe("t", arr)[1], device="cuda:0", ready=ready)


def _stager(cuda_build=False, nic_gpu=False, force="auto", ops=None):
    ops = ops or HostOps()
    return Stager(lambda: cuda_build, lambda: nic_gpu, force, lambda: ops), ops


def test_host_regions_are_never_touched():
    asked = []
    stager = Stager(lambda: asked.append(1) or True, lambda: True)
    region = describe("x", np.zeros(8, np.uint8))[1]
    assert stager.outbound([region]) is None and stager.inbound([region]) is None
    assert asked == []  # a CPU-only process never reads Mooncake's files


def test_staged_send_copies_only_the_chunk_after_the_ready_event():
    src = np.arange(64, dtype=np.uint8)
    events = []
    region = _device_region(src, ready=lambda: events.append("ready"))
    host = describe("h", np.zeros(8, np.uint8))[1]
    stager, _ = _stager()
    staged = stager.outbound([host, region])
    assert staged is not None and staged.path == "host+staged"
    assert staged.regions[0] is host  # host memory goes as it is
    out = staged.regions[1]
    assert (out.device, out.nbytes) == ("cpu", 64) and out.ptr != region.ptr
    assert (out.ptr - out.base_ptr) % 4096 == 0  # page-aligned within the pinned buffer
    staged.send([Segment(1, 16, 8)])
    assert events == ["ready"]
    view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 64).from_address(out.ptr))
    assert list(view[16:24]) == list(range(16, 24))
    assert not view[:16].any() and not view[24:].any()
    staged.release()


def test_staged_receive_moves_landed_bytes_into_the_device_destination():
    dst = np.zeros(32, np.uint8)
    stager, _ = _stager()
    staged = stager.inbound([_device_region(dst)])
    assert staged is not None
    land = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * 32).from_address(staged.regions[0].ptr)
    )
    land[:] = np.arange(100, 132, dtype=np.uint8)
    staged.receive([Segment(0, 0, 16)])
    assert list(dst[:16]) == list(range(100, 116)) and not dst[16:].any()
    staged.receive([Segment(0, 16, 16)])
    assert list(dst) == list(range(100, 132))
    staged.release()


def test_gpu_direct_moves_the_tensor_itself_once_its_stream_got_there():
    src = np.ones(16, np.uint8)
    region = _device_region(src)
    stager, ops = _stager(cuda_build=True, nic_gpu=True)
    staged = stager.outbound([region])
    assert staged is not None and staged.path == "gpu-direct" and staged.device_direct
    assert staged.regions[0] is region  # registered and moved in place
    staged.send([Segment(0, 0, 8), Segment(0, 8, 8)])
    assert ops.waited == [region.ptr]  # one wait per tensor, no copy
    inbound = stager.inbound([_device_region(np.zeros(4, np.uint8))])
    assert inbound is not None and len(ops.waited) == 2  # destination free before the NIC writes


def test_core_never_synchronizes_a_whole_device():
    """Device work is ordered by events on the streams involved only."""
    import pathlib
    import re

    import mooncake_diffusion

    root = pathlib.Path(mooncake_diffusion.__file__).parent
    calls = re.compile(r"cuda\.synchronize\(|device_synchronize|cudaDeviceSynchronize")
    offenders = [str(p) for p in root.rglob("*.py") if calls.search(p.read_text())]
    assert offenders == []

"""Device tensors through the real connector: p2p and store, staged and GPU-direct,
ordering by CUDA events, registration of device memory. Needs a CUDA device
(reported "not run: no CUDA device" without one, see conftest.py)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import DiffusionConnector, StagePayload
from mooncake_diffusion.errors import AlreadyConsumedError, DestinationMismatchError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.deployment import cuda_build
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transfer.transports.p2p import P2PTransport

CASES = [(m, p) for m in ("p2p", "store") for p in ("staged", "gpu-direct")]


@pytest.fixture
def device_pair(mooncake_cluster, request):
    """A producer and a consumer connector with ``gpu_path`` from the test's
    parameters, the same-host path off (bytes cross the Transfer Engine)."""
    mode, gpu_path = request.param
    if gpu_path == "gpu-direct" and not cuda_build():
        pytest.skip("not run: the installed Mooncake is not a CUDA build (pip install "
                    "'mooncake-diffusion[cuda13]' or [cuda12] to match torch)")  # fmt: skip
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    settings = dataclasses.replace(mooncake_cluster.settings, same_host=False, gpu_path=gpu_path)
    prod = DiffusionConnector("denoise", mode, settings)  # type: ignore[arg-type]
    cons = DiffusionConnector("decode", mode, settings)  # type: ignore[arg-type]
    yield prod, cons, gpu_path
    for c in (prod, cons):
        s = c.stats()
        c.close()
        assert s.temporary_registrations == 0 and s.pool_bytes_in_use == 0, s
    torch.cuda.current_stream().synchronize()
    assert_no_leaks(mooncake_cluster, baseline)


@pytest.mark.parametrize("device_pair", CASES, indirect=True, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int64"])
def test_device_bytes_arrive_unchanged_in_a_device_destination(device_pair, dtype):
    prod, cons, gpu_path = device_pair
    x = make_tensor(dtype, (2, 3, 64, 65), 7).cuda()
    dst = torch.empty_like(x)
    pub = prod.publish(StagePayload("r1", "latent", tensor=x))
    got = cons.consume(pub.wait(30), dst=dst)
    assert got.tensor is dst and same_bytes(dst.cpu(), x.cpu())
    assert f"dst={gpu_path}" in got.path, got.path
    got.release()


@pytest.mark.parametrize("device_pair", CASES, indirect=True, ids=lambda c: "-".join(c))
def test_chunked_multi_tensor_payload_between_devices(device_pair):
    prod, cons, _ = device_pair
    src = {
        "latent": make_tensor("bfloat16", (1, 4, 8, 32, 32), 2).cuda(),
        "mask": make_tensor("int64", (1, 4, 8, 1, 1), 3).cuda(),
    }
    pub = prod.publish(StagePayload("r1", "latent", tensors=src, chunk_dim=2, num_chunks=4))
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    got = cons.consume(pub.wait(30), dst=dst)
    assert all(same_bytes(dst[k].cpu(), src[k].cpu()) for k in src)
    got.release()


@pytest.mark.parametrize("device_pair", CASES, indirect=True, ids=lambda c: "-".join(c))
def test_publish_waits_for_the_producing_stream(device_pair):
    """The tensor is written by a kernel queued behind a long sleep on a side
    stream, and published at once from that stream: the consumer must see the
    written values, so the transport waited for that stream's event. (That core
    never synchronizes the whole device is checked on CPU, in
    tests/unit/test_device_paths.py.)"""
    prod, cons, _ = device_pair
    x = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second before the write starts
        x.fill_(3.0)
        pub = prod.publish(StagePayload("r1", "latent", tensor=x))
    dst = torch.empty_like(x)
    got = cons.consume(pub.wait(60), dst=dst)
    assert bool((dst == 3.0).all())
    got.release()


@pytest.mark.parametrize("device_pair", CASES, indirect=True, ids=lambda c: "-".join(c))
def test_device_contract_errors(device_pair):
    prod, cons, _ = device_pair
    x = make_tensor("float16", (4, 16), 5).cuda()
    handle = prod.publish(StagePayload("r1", "latent", tensor=x)).wait(30).encode()
    with pytest.raises(DestinationMismatchError):
        cons.consume(handle, dst=torch.empty(3, 16, dtype=torch.float16, device="cuda"))
    cons.consume(handle, dst=torch.empty_like(x)).release()
    with pytest.raises(AlreadyConsumedError):
        cons.consume(handle, dst=torch.empty_like(x))


def test_a_cuda_build_registers_device_memory_once(mooncake_cluster):
    if not cuda_build():
        pytest.skip("not run: the installed Mooncake is not a CUDA build")
    t = P2PTransport(mooncake_cluster.settings)
    try:
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        region = describe("x", x)[1]
        t.pin(region)
        t.pin(describe("x", x[1024:])[1])  # a view of the same allocation: no new extent
        assert t.registered()[0] == 1
        t.unpin(region)
        assert t.registered() == (0, 0, 0)
    finally:
        t.close()

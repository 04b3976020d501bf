"""``TorchCudaOps.flush``: a flush cut off waits for the rest next time.

Pure logic: torch's CUDA API is replaced by a stand-in (this machine has no GPU)
whose event on one device fails its first wait, as a CUDA error or an interrupt
would. The same code runs on real streams in the GPU tier."""

from __future__ import annotations

import threading

import pytest

from mooncake_diffusion.transfer.staging import TorchCudaOps

pytestmark = pytest.mark.unit


class _Cuda:
    """The slice of ``torch.cuda`` ``TorchCudaOps`` uses: streams named by device,
    events that record which device's stream they waited for."""

    def __init__(self) -> None:
        self.waited: list[str] = []
        self.fail_once = {"cuda:1"}
        cuda = self

        class Stream:
            def __init__(self, device: str) -> None:
                self.device = device

        class Event:
            def record(self, stream: Stream) -> None:
                self.device = stream.device

            def synchronize(self) -> None:
                if self.device in cuda.fail_once:
                    cuda.fail_once.discard(self.device)
                    raise RuntimeError(f"CUDA error on {self.device}")
                cuda.waited.append(self.device)

        self.Stream, self.Event = Stream, Event


class _Torch:
    def __init__(self) -> None:
        self.cuda = _Cuda()


def test_a_flush_cut_off_leaves_the_devices_it_did_not_reach_to_the_next():
    ops = TorchCudaOps()
    ops._torch = _Torch()  # type: ignore[assignment]
    for device in ("cuda:0", "cuda:1", "cuda:2"):
        ops._stream(device)  # a copy queued on each device's stream
    with pytest.raises(RuntimeError, match="cuda:1"):
        ops.flush()
    cuda = ops._torch.cuda
    assert cuda.waited == ["cuda:0"]
    ops.flush()  # waits for what the first one did not: cuda:1 and cuda:2
    assert cuda.waited == ["cuda:0", "cuda:1", "cuda:2"]
    ops.flush()  # nothing used since: no wait
    assert cuda.waited == ["cuda:0", "cuda:1", "cuda:2"]
    # per thread: another thread's flush waits only for its own devices
    other: list[BaseException] = []

    def elsewhere() -> None:
        try:
            ops._stream("cuda:3")
            ops.flush()
        except BaseException as e:
            other.append(e)

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join(30)
    assert not t.is_alive() and other == []
    assert cuda.waited[-1] == "cuda:3" and len(cuda.waited) == 4

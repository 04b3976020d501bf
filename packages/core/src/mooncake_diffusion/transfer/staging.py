"""Device regions on the wire: GPU-direct where it works, pinned host staging
otherwise, ordered by CUDA events (``device`` chooses; this applies it).

One ``Stager`` per transport. Around each transfer the transport calls:

    staged = stager.outbound(regions)   # producer; None: all host memory, nothing to do
    staged.regions                      # what the engine registers and moves instead
    staged.send(segments)               # before those bytes leave (per chunk):
                                        #   gpu-direct: wait for the tensor's ready event
                                        #   staged: device -> pinned host copy, then wait
    staged.release()                    # once no transfer reads staged.regions

    staged = stager.inbound(regions)    # consumer; None: all host memory
    ...engine writes into staged.regions...
    staged.receive(segments)            # after those bytes landed: pinned host -> device
    staged.release()

``Region.ready`` is the CUDA event ``tensors.describe`` recorded on the tensor's
current stream when it was published (or offered as a destination): copies and
sends wait for that event only, never for the whole device. ``send`` and
``receive`` block the calling thread until their own copies are done, so the
pinned buffer may be reused and the consumer's kernels see the bytes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mooncake_diffusion.memory.device import DevicePath, choose_path, describe_paths, plan_staging
from mooncake_diffusion.memory.tensors import Region
from mooncake_diffusion.transfer.chunks import Segment

__all__ = ["DeviceOps", "HostOps", "Staged", "Stager", "TorchCudaOps"]


class DeviceOps(Protocol):
    """The device calls staging needs. ``copy_*`` may be asynchronous; ``flush``
    returns once every copy this object queued on the calling thread is done."""

    def host_buffer(self, nbytes: int) -> tuple[Any, int]:
        """A pinned host buffer of ``nbytes``: (owner, address)."""
        ...

    def copy_out(self, host: Any, at: int, src: Region, offset: int, n: int) -> None:
        """Device ``src[offset:offset + n]`` to ``host[at:at + n]``, after ``src.ready``."""
        ...

    def copy_in(self, dst: Region, offset: int, host: Any, at: int, n: int) -> None:
        """``host[at:at + n]`` to device ``dst[offset:offset + n]``, after ``dst.ready``."""
        ...

    def wait_ready(self, region: Region) -> None:
        """Block until the stream that produced ``region`` reached its ready event."""
        ...

    def flush(self) -> None: ...


class TorchCudaOps:
    """``DeviceOps`` on torch's CUDA API: a copy stream per device and thread,
    pinned buffers from torch, events (never ``torch.cuda.synchronize``)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._local = threading.local()

    def _stream(self, device: str) -> Any:
        streams = self._local.__dict__.setdefault("streams", {})
        if device not in streams:
            streams[device] = self._torch.cuda.Stream(device=device)
        self._local.__dict__.setdefault("used", set()).add(device)
        return streams[device]

    def _bytes(self, region: Region) -> Any:
        return region.owner.reshape(-1).view(self._torch.uint8)

    def host_buffer(self, nbytes: int) -> tuple[Any, int]:
        buf = self._torch.empty(max(nbytes, 1), dtype=self._torch.uint8, pin_memory=True)
        return buf, int(buf.data_ptr())

    def copy_out(self, host: Any, at: int, src: Region, offset: int, n: int) -> None:
        stream = self._stream(str(src.owner.device))
        if src.ready is not None:
            stream.wait_event(src.ready)
        with self._torch.cuda.stream(stream):
            host[at : at + n].copy_(self._bytes(src)[offset : offset + n], non_blocking=True)

    def copy_in(self, dst: Region, offset: int, host: Any, at: int, n: int) -> None:
        stream = self._stream(str(dst.owner.device))
        if dst.ready is not None:
            stream.wait_event(dst.ready)
        with self._torch.cuda.stream(stream):
            self._bytes(dst)[offset : offset + n].copy_(host[at : at + n], non_blocking=True)

    def wait_ready(self, region: Region) -> None:
        if region.ready is not None:
            region.ready.synchronize()

    def flush(self) -> None:
        """Wait for this thread's copies on every device it used since the last
        flush; a device leaves that set only once its wait returned, so a flush cut
        off (a CUDA error, an interrupt) leaves the rest to the next one."""
        used = self._local.__dict__.get("used", set())
        streams = self._local.__dict__.get("streams", {})
        for device in sorted(used):
            done = self._torch.cuda.Event()
            done.record(streams[device])
            done.synchronize()
            used.discard(device)


class HostOps:
    """``DeviceOps`` for regions that only claim a device but live in host memory:
    plain copies, ``ready`` called if it is callable. For tests of the staging
    logic on machines without a GPU; same contract as ``TorchCudaOps``."""

    def __init__(self) -> None:
        self.waited: list[int] = []  # ptrs whose ready event was waited for, in order

    def host_buffer(self, nbytes: int) -> tuple[Any, int]:
        buf = (ctypes.c_uint8 * max(nbytes, 1))()
        return buf, ctypes.addressof(buf)

    def _ready(self, region: Region) -> None:
        self.waited.append(region.ptr)
        if callable(region.ready):
            region.ready()

    def copy_out(self, host: Any, at: int, src: Region, offset: int, n: int) -> None:
        self._ready(src)
        ctypes.memmove(ctypes.addressof(host) + at, src.ptr + offset, n)

    def copy_in(self, dst: Region, offset: int, host: Any, at: int, n: int) -> None:
        self._ready(dst)
        ctypes.memmove(dst.ptr + offset, ctypes.addressof(host) + at, n)

    def wait_ready(self, region: Region) -> None:
        self._ready(region)

    def flush(self) -> None:
        return None


class Staged:
    """The device side of one transfer (see the module docstring). Not thread-safe
    per instance except ``send``/``receive`` of disjoint segments."""

    def __init__(
        self, originals: Sequence[Region], paths: Sequence[DevicePath], ops: DeviceOps
    ) -> None:
        self.originals = list(originals)
        self.paths = list(paths)
        self._ops = ops
        sizes = [r.nbytes if p == "staged" else 0 for r, p in zip(originals, paths, strict=True)]
        self._offsets, total = plan_staging(sizes)
        self._buffer: Any = None
        self.regions = list(originals)
        if total:
            self._buffer, base = ops.host_buffer(total)
            for i, (r, p) in enumerate(zip(originals, paths, strict=True)):
                if p == "staged":
                    at = base + self._offsets[i]
                    self.regions[i] = Region(at, r.nbytes, self._buffer, "cpu", base, total)
        #: what the transport appends to its path string, e.g. "staged"
        self.path = describe_paths(paths)
        #: some region is device memory the engine touches directly: no
        #: same-host memcpy or process_vm_writev may be used on it
        self.device_direct = "gpu-direct" in self.paths
        #: every byte goes through the pinned buffer: the engine writes no region
        #: of the caller's (on a consumer, a late write can land only in the buffer)
        self.covers_all = all(
            p == "staged" or not r.nbytes for r, p in zip(originals, paths, strict=True)
        )

    def send(self, segments: Sequence[Segment]) -> None:
        """Make ``segments`` readable by the engine: block until done."""
        waited: set[int] = set()
        for s in segments:
            r, p = self.originals[s.tensor], self.paths[s.tensor]
            if p == "staged":
                at = self._offsets[s.tensor] + s.offset
                self._ops.copy_out(self._buffer, at, r, s.offset, s.length)
            elif p == "gpu-direct" and s.tensor not in waited:
                waited.add(s.tensor)
                self._ops.wait_ready(r)
        self._ops.flush()

    def receive(self, segments: Sequence[Segment]) -> None:
        """Move landed ``segments`` into the device destinations: block until done."""
        for s in segments:
            if self.paths[s.tensor] == "staged":
                at = self._offsets[s.tensor] + s.offset
                self._ops.copy_in(self.originals[s.tensor], s.offset, self._buffer, at, s.length)
        self._ops.flush()

    def settle(self) -> bool:
        """After a ``send`` or ``receive`` broke off: wait for the copies this thread
        had queued. False when that wait failed too (they may still run)."""
        try:
            self._ops.flush()
        except Exception:
            return False
        return True

    def release(self) -> None:
        """Drop the pinned buffer (after the engine stopped using ``regions``)."""
        self._buffer = None


class Stager:
    """Chooses each region's path for one transport; ``cuda_build`` is asked once,
    on the first device region (so a CPU-only process never reads Mooncake's files)."""

    def __init__(
        self,
        cuda_build: Callable[[], bool],
        nic_gpu: Callable[[], bool],
        force: str = "auto",
        ops: Callable[[], DeviceOps] = TorchCudaOps,
    ) -> None:
        self._cuda_build, self._nic_gpu = cuda_build, nic_gpu
        self._force = force
        self._make_ops = ops
        self._ops: DeviceOps | None = None
        self._caps: tuple[bool, bool] | None = None
        self._lock = threading.Lock()

    def _paths(self, regions: Sequence[Region]) -> list[DevicePath] | None:
        for r in regions:
            if r.device != "cpu":
                break
        else:
            return None  # the CPU path, untouched
        with self._lock:
            if self._caps is None:
                self._caps = (self._cuda_build(), self._nic_gpu())
            if self._ops is None:
                self._ops = self._make_ops()
        build, nic = self._caps
        return [
            choose_path(r.device, cuda_build=build, nic_gpu=nic, force=self._force) for r in regions
        ]

    def outbound(self, regions: Sequence[Region]) -> Staged | None:
        """For a producer's ``regions``; ``None`` when all are host memory."""
        paths = self._paths(regions)
        if paths is None:
            return None
        assert self._ops is not None
        return Staged(regions, paths, self._ops)

    def inbound(self, regions: Sequence[Region]) -> Staged | None:
        """For a consumer's destinations; waits until GPU-direct destinations are
        free to be written (their ready event). ``None`` when all are host memory."""
        staged = self.outbound(regions)
        if staged is not None:
            for r, p in zip(staged.originals, staged.paths, strict=True):
                if p == "gpu-direct":
                    assert self._ops is not None
                    self._ops.wait_ready(r)
        return staged

"""Same-host fast path: write straight into another local process's memory.

Two mechanisms, both one copy, where loopback TCP through the Transfer Engine
manages 1-2.5 GB/s:

- ``SharedPool``: a consumer's receive pool lives in a memfd. The producer
  maps it once (``PeerPools.map``, through ``/proc/<pid>/fd/<fd>``) and then
  copies with plain memcpy: memory speed (20 GB/s here).
- ``vm_write``: ``process_vm_writev`` into any destination of the consumer
  (its own tensors): about 8 GB/s here, as the kernel pins pages one by one.
  ``vm_read`` is its reverse, which a store client uses to read an object out of
  a store host on its host (``listener_pid`` finds that process by its port).

Both need the processes on one kernel and in one PID namespace
(``host_identity`` tells), and the right to access the other process's memory
(same user, or CAP_SYS_PTRACE, under the kernel's ptrace policy); callers fall
back to the network when they raise.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PeerPools",
    "SharedPool",
    "host_identity",
    "listener_pid",
    "process_gone",
    "vm_read",
    "vm_write",
]

_IOV_MAX = 1024


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def host_identity() -> str:
    """Equal for two processes exactly when one can address the other by pid:
    the kernel boot id plus the PID namespace; "" where it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}"


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``SIGSTOP``, a debugger): alive, reading
    nothing. A copy into its memory succeeds all the same."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] in ("T", "t")
    except (FileNotFoundError, IndexError, PermissionError):
        return False


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as exited). A pool
    mapped from it stays writable after its death, so writers ask after copying."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def vm_write(pid: int, parts: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(local_ptr, remote_ptr, length)`` into process ``pid``.

    Blocks until every byte is written; raises ``OSError`` (EPERM, ESRCH,
    EFAULT, ENOSYS...) with nothing guaranteed about partially written parts.
    """
    _vm_copy(pid, parts, write=True)


def vm_read(pid: int, parts: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(local_ptr, remote_ptr, length)`` out of process ``pid``: the
    reverse of ``vm_write``, with its errors."""
    _vm_copy(pid, parts, write=False)


def _vm_copy(pid: int, parts: Sequence[tuple[int, int, int]], *, write: bool) -> None:
    libc = _libc()
    call, name = (
        (libc.process_vm_writev, "process_vm_writev to")
        if write
        else (libc.process_vm_readv, "process_vm_readv from")
    )
    todo = [p for p in parts if p[2]]
    while todo:
        batch, todo = todo[:_IOV_MAX], todo[_IOV_MAX:]
        n = len(batch)
        local = (_IOVec * n)(*[_IOVec(p[0], p[2]) for p in batch])
        remote = (_IOVec * n)(*[_IOVec(p[1], p[2]) for p in batch])
        want = sum(p[2] for p in batch)
        done = call(pid, local, n, remote, n, 0)
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name} pid {pid}: {os.strerror(err)}")
        if done < want:  # partial: resume after the bytes that went
            rest, skip = [], done
            for lp, rp, ln in batch:
                if skip >= ln:
                    skip -= ln
                    continue
                rest.append((lp + skip, rp + skip, ln - skip))
                skip = 0
            todo = rest + todo


def listener_pid(port: int) -> int | None:
    """The process of this PID namespace that listens on TCP ``port`` (any local
    address), or ``None``: nobody does, or its process is not visible here (another
    PID namespace, another user's without the right to look). One scan of ``/proc``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None


class SharedPool:
    """A receive buffer in a memfd, so a producer on this host can map it.

    ``tensor`` is a uint8 view of the whole buffer (torch when available, else
    numpy); ``fd``/``token`` identify it to producers. ``close()`` closes the fd
    (the memory lives on while views of it do).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("mooncake-diffusion-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self.token = uuid.uuid4().hex
        try:
            import torch

            self.tensor: Any = torch.frombuffer(self._map, dtype=torch.uint8)
        except ImportError:
            import numpy as np

            self.tensor = np.frombuffer(self._map, dtype=np.uint8)
        self.base = _buffer_address(self._map)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _buffer_address(buf: mmap.mmap) -> int:
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    address = ctypes.addressof(view)
    del view  # drop the export so the mmap stays closable
    return address


class PeerPools:
    """A producer's mappings of consumers' ``SharedPool``s, by token.

    ``map`` opens and maps a pool on first use (raises ``OSError`` when the
    kernel refuses); later calls return the cached base address. A token is
    random per pool, so a recycled pid or fd number never matches a stale
    mapping. Mappings live until ``close()``.
    """

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}
        self._lock = threading.Lock()

    def map(self, pid: int, fd: int, token: str, nbytes: int) -> int:
        with self._lock:
            hit = self._maps.get(token)
            if hit is not None:
                return hit[1]
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                if os.fstat(f).st_size < nbytes:
                    raise OSError(f"pool of pid {pid} is smaller than announced")
                m = mmap.mmap(f, nbytes)
            finally:
                os.close(f)
            base = _buffer_address(m)
            self._maps[token] = (m, base)
            return base

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for m, _ in maps:
            m.close()

"""The transport contract: move the chunks of one payload between processes.

A transport knows nothing about diffusion. One instance per connector and
mode; a payload is a list of chunks (``chunks.plan``), each a list of byte
segments of its tensors; an unchunked payload is one chunk. The connector
calls, in this order:

    producer side (DiffusionConnector.publish, Publication.chunk_ready)
      prepare(payload_id, regions, lease, plan)
                    caller thread; cheap; returns the Source for the handle
      commit(payload_id, source, regions, lease, plan, chunk)
                    a publish worker thread, once per chunk, in any order,
                    possibly concurrently; blocks while bytes move; after it
                    returns a consumer can receive that chunk
      discard(handle)
                    release/cleanup/error: every byte of the payload is removed
                    wherever it is; idempotent; may race a fetch in progress
    consumer side (DiffusionConnector.consume)
      fetch(handle, regions, plan, deadline, on_chunk) -> path
                    one thread; blocks until every chunk landed in ``regions``
                    or raises; calls ``on_chunk(i)`` on that thread as chunk i
                    lands (any order; once per chunk); returns how the bytes
                    came ("p2p/net", "p2p/shm", "store", "memory")
    both
      pin(region) / unpin(region)   register caller memory once
      registered() -> (count, bytes, temporary)   for leak checks
      close()                       idempotent; nothing stays registered

A transport whose producer writes into the consumer says, with
``may_write_late(error)``, whether a fetch that raised ``error`` may still be
written into (p2p: the fetch broke off before the producer's final reply), and in
``late_write_s`` how long after the fetch's deadline (or the error, if later) its
bytes may still land: the consumer keeps that memory out of use, and alive, that
long.

Regions passed to ``prepare``/``commit`` must stay alive, and a chunk's bytes
unchanged, until ``commit`` of that chunk returns (store) or the payload is
consumed or discarded (p2p); the connector holds them. ``fetch`` regions are
written in place. Errors are those of ``mooncake_diffusion.errors``;
``PayloadGoneError`` from ``fetch`` means the payload is not there (consumed,
expired or never published). ``fetch(..., committed=True)``: the caller knows the
whole payload was committed before (an acknowledged stage output), so a transport
that would wait for a payload still being published (store) reports one it does not
find as gone at once instead of at the deadline.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from mooncake_diffusion.memory.tensors import Region
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.chunks import Segment
from mooncake_diffusion.wire.schema import LeaseMode, PayloadHandle

__all__ = ["Plan", "Transport"]

Source = object  # one of schema.P2PSource | StoreSource | MemorySource
Plan = Sequence[Sequence[Segment]]


class Transport(ABC):
    """Base class of p2p, store and memory transports (see the module docstring)."""

    name: ClassVar[str]
    #: seconds after a fetch's deadline (or its error, if later) during which the
    #: peer's bytes may still land after ``may_write_late``: forever unless a
    #: transport that writes late says otherwise
    late_write_s: float = math.inf

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings

    @abstractmethod
    def prepare(
        self, payload_id: str, regions: Sequence[Region], lease: LeaseMode, plan: Plan
    ) -> Source: ...

    @abstractmethod
    def commit(
        self,
        payload_id: str,
        source: Source,
        regions: Sequence[Region],
        lease: LeaseMode,
        plan: Plan,
        chunk: int,
    ) -> None: ...

    @abstractmethod
    def discard(self, handle: PayloadHandle) -> None: ...

    @abstractmethod
    def fetch(
        self,
        handle: PayloadHandle,
        regions: Sequence[Region],
        plan: Plan,
        deadline: float,
        on_chunk: Callable[[int], None],
        *,
        committed: bool = False,
    ) -> str: ...

    def may_write_late(self, error: BaseException) -> bool:
        """Whether the peer may still write into the regions of a fetch that raised
        ``error`` (then the consumer holds them back for ``late_write_s``). None
        may by default: the transport's reads had all ended when ``fetch`` raised."""
        return False

    @abstractmethod
    def pin(self, region: Region) -> None: ...

    @abstractmethod
    def unpin(self, region: Region) -> None: ...

    @abstractmethod
    def registered(self) -> tuple[int, int, int]: ...

    @abstractmethod
    def close(self) -> None: ...

"""The transport contract: move the byte ranges of one payload between processes.

A transport knows nothing about diffusion. One instance per connector and
mode; the connector calls, in this order:

    producer side (DiffusionConnector.publish)
      prepare(payload_id, regions, lease)  caller thread; cheap; returns the Source
                                           that goes into the handle
      commit(payload_id, source, regions, lease)
                                           a publish worker thread; blocks while
                                           bytes move; after it returns a
                                           consumer can fetch
      discard(source, handle)              release/cleanup/error: the bytes are
                                           removed wherever they are; idempotent
    consumer side (DiffusionConnector.consume)
      fetch(handle, regions, deadline)     caller thread; blocks until every
                                           region holds its bytes or raises
    both
      pin(region) / unpin(region)          register caller memory once
      registered() -> (count, bytes, temporary)  for leak checks
      close()                              idempotent; nothing stays registered

Regions passed to ``prepare``/``commit`` must stay alive and unchanged until
``commit`` returns (store) or the payload is consumed or discarded (p2p); the
connector holds them. ``fetch`` regions are written in place. Errors are
those of ``mooncake_diffusion.errors``; ``PayloadGoneError`` from ``fetch``
means the payload is not there (consumed, expired or never published).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from mooncake_diffusion.schema import LeaseMode, PayloadHandle
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.tensors import Region

__all__ = ["Transport"]

Source = object  # one of schema.P2PSource | StoreSource | MemorySource


class Transport(ABC):
    """Base class of p2p, store and memory transports (see the module docstring)."""

    name: ClassVar[str]

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings

    @abstractmethod
    def prepare(self, payload_id: str, regions: Sequence[Region], lease: LeaseMode) -> Source: ...

    @abstractmethod
    def commit(
        self, payload_id: str, source: Source, regions: Sequence[Region], lease: LeaseMode
    ) -> None: ...

    @abstractmethod
    def discard(self, handle: PayloadHandle) -> None: ...

    @abstractmethod
    def fetch(self, handle: PayloadHandle, regions: Sequence[Region], deadline: float) -> None: ...

    @abstractmethod
    def pin(self, region: Region) -> None: ...

    @abstractmethod
    def unpin(self, region: Region) -> None: ...

    @abstractmethod
    def registered(self) -> tuple[int, int, int]: ...

    @abstractmethod
    def close(self) -> None: ...

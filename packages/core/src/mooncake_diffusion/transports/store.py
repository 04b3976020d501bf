"""Relay through Mooncake Store: the producer puts, any consumer gets, later.

Keys are ``f"{prefix}/{i}"`` for each non-empty tensor ``i``, with a prefix
unique per publication (Store's ``put`` never overwrites, so keys are never
reused). Delete-on-consume objects are hard-pinned (never evicted before their
consumer comes) and removed with force right after the read; shared objects
are soft-pinned and stay until discarded. A consumer that arrives before the
put finishes polls with bounded backoff (0.5 ms doubling to 20 ms) until its
deadline.

In store mode the producer cannot know when a payload was consumed; two
consumers racing on one delete-on-consume payload may both read it before
the first removes it (the orchestrator gives each payload one consumer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import DeadlineExceededError, PayloadGoneError
from mooncake_diffusion.schema import LeaseMode, PayloadHandle, StoreSource
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.tensors import Region
from mooncake_diffusion.transports.base import Transport

__all__ = ["KEY_ROOT", "StoreTransport"]

#: Every key this package writes starts with this, so an operator can find them.
KEY_ROOT = "mcd/"


def _keys(prefix: str, sizes: Sequence[int]) -> list[str]:
    return [f"{prefix}/{i}" for i, n in enumerate(sizes) if n]


class StoreTransport(Transport):
    name = "store"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self._client = StoreClient(settings)

    def prepare(self, payload_id: str, regions: Sequence[Region], lease: LeaseMode) -> StoreSource:
        return StoreSource(KEY_ROOT + payload_id)

    def commit(
        self, payload_id: str, source: object, regions: Sequence[Region], lease: LeaseMode
    ) -> None:
        assert isinstance(source, StoreSource)
        src = [r for r in regions if r.nbytes]
        leases = []
        try:
            for r in src:
                leases.append(self._client.regs.acquire(r))
            self._client.put_many(
                _keys(source.prefix, [r.nbytes for r in regions]),
                [r.ptr for r in src],
                [r.nbytes for r in src],
                pin="hard" if lease == "delete_on_consume" else "soft",
            )
        finally:
            for lease_id in leases:
                self._client.regs.release(lease_id)

    def discard(self, handle: PayloadHandle) -> None:
        assert isinstance(handle.source, StoreSource)
        self._client.remove_many(_keys(handle.source.prefix, [t.nbytes for t in handle.tensors]))

    def fetch(self, handle: PayloadHandle, regions: Sequence[Region], deadline: float) -> None:
        assert isinstance(handle.source, StoreSource)
        keys = _keys(handle.source.prefix, [t.nbytes for t in handle.tensors])
        dst = [r for r in regions if r.nbytes]
        leases = [self._client.regs.acquire(r) for r in dst]
        try:
            pending = list(range(len(keys)))
            delay = 0.0005
            while pending:
                found = self._client.get_many(
                    [keys[i] for i in pending],
                    [dst[i].ptr for i in pending],
                    [dst[i].nbytes for i in pending],
                )
                pending = [i for i, ok in zip(pending, found, strict=True) if not ok]
                if not pending:
                    break
                if time.monotonic() + delay > deadline:
                    if len(pending) < len(keys):  # some landed: the producer is mid-put
                        raise DeadlineExceededError(
                            f"payload {handle.payload_id}: {len(pending)} of {len(keys)} "
                            "objects still missing at the deadline"
                        )
                    raise PayloadGoneError(
                        f"payload {handle.payload_id} is not in the store: not yet published "
                        "by the deadline, already consumed, or removed"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        finally:
            for lease_id in leases:
                self._client.regs.release(lease_id)
        if handle.lease == "delete_on_consume":
            self._client.remove_many(keys)

    def pin(self, region: Region) -> None:
        self._client.regs.pin(region)

    def unpin(self, region: Region) -> None:
        self._client.regs.unpin(region)

    def registered(self) -> tuple[int, int, int]:
        return self._client.regs.count, self._client.regs.nbytes, self._client.regs.temporary

    def remove_request(self, request_id: str) -> int:
        """Remove every object of ``request_id`` in the store, whoever published it."""
        return self._client.remove_prefix(f"{KEY_ROOT}{request_id}/")

    def close(self) -> None:
        self._client.close()

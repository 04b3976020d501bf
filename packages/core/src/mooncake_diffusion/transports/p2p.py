"""Peer to peer over the Transfer Engine: the producer pushes into the consumer.

Publishing only registers the producer's tensors (once per allocation) and
records them; no byte moves until a consumer asks. ``fetch`` sends the
consumer's registered destinations over the side channel; the producer
claims the payload, writes it with ``batch_transfer_sync_write`` and replies.
A delete-on-consume payload is claimed by exactly one fetch, even across
processes; a failed write un-claims it so the consumer may retry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake_diffusion._mooncake.engine import Engine
from mooncake_diffusion.errors import (
    AlreadyConsumedError,
    DestinationMismatchError,
    MooncakeDiffusionError,
    PayloadGoneError,
    TransferError,
)
from mooncake_diffusion.schema import FetchReply, FetchRequest, LeaseMode, P2PSource, PayloadHandle
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.sidechannel import SideChannelClient, SideChannelServer
from mooncake_diffusion.tensors import Region
from mooncake_diffusion.transports.base import Transport

__all__ = ["P2PTransport"]

_TOMBSTONES = 65536  # consumed payload ids remembered, to tell "consumed" from "gone"


@dataclass
class _Held:
    regions: list[Region]
    leases: list[int]
    lease: LeaseMode
    claimed: bool = False


class P2PTransport(Transport):
    name = "p2p"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self._engine = Engine(settings)
        self._server: SideChannelServer | None = None
        self._client = SideChannelClient()
        self._held: dict[str, _Held] = {}
        self._consumed: OrderedDict[str, None] = OrderedDict()  # tombstones, bounded
        self._lock = threading.Lock()

    # producer side -----------------------------------------------------------
    def prepare(self, payload_id: str, regions: Sequence[Region], lease: LeaseMode) -> P2PSource:
        with self._lock:
            if self._server is None:
                self._server = SideChannelServer(self.settings.local_hostname, self._serve)
        leases: list[int] = []
        try:
            for r in regions:
                leases.append(self._engine.regs.acquire(r))
        except BaseException:
            for lease_id in leases:
                self._engine.regs.release(lease_id)
            raise
        with self._lock:
            self._held[payload_id] = _Held(list(regions), leases, lease)
        return P2PSource(self._engine.segment, self._server.endpoint)

    def commit(
        self, payload_id: str, source: object, regions: Sequence[Region], lease: LeaseMode
    ) -> None:
        """Nothing to move: the bytes wait in the producer's registered memory."""

    def discard(self, handle: PayloadHandle) -> None:
        self._drop(handle.payload_id)

    def _drop(self, payload_id: str) -> None:
        with self._lock:
            held = self._held.pop(payload_id, None)
        if held is not None:
            for lease_id in held.leases:
                self._engine.regs.release(lease_id)

    def _serve(self, req: FetchRequest) -> FetchReply:
        with self._lock:
            held = self._held.get(req.payload_id)
            if held is None:
                if req.payload_id in self._consumed:
                    return FetchReply("consumed", f"payload {req.payload_id} was already consumed")
                return FetchReply("gone", f"payload {req.payload_id} is not held by this producer")
            if held.claimed:
                return FetchReply("consumed", f"payload {req.payload_id} was already consumed")
            src = [r for r in held.regions if r.nbytes]
            if tuple(r.nbytes for r in src) != req.lengths or len(req.addrs) != len(src):
                return FetchReply(
                    "mismatch",
                    f"consumer asked for {req.lengths}, payload has {tuple(r.nbytes for r in src)}",
                )
            if held.lease == "delete_on_consume":
                held.claimed = True
        try:
            self._engine.write(req.segment, [r.ptr for r in src], req.addrs, req.lengths)
        except MooncakeDiffusionError as e:
            with self._lock:
                held.claimed = False
            return FetchReply("failed", str(e))
        if held.lease == "delete_on_consume":
            with self._lock:
                self._consumed[req.payload_id] = None
                while len(self._consumed) > _TOMBSTONES:
                    self._consumed.popitem(last=False)
            self._drop(req.payload_id)
        return FetchReply("ok")

    # consumer side -----------------------------------------------------------
    def fetch(self, handle: PayloadHandle, regions: Sequence[Region], deadline: float) -> None:
        source = handle.source
        assert isinstance(source, P2PSource)
        dst = [r for r in regions if r.nbytes]
        leases = [self._engine.regs.acquire(r) for r in dst]
        try:
            req = FetchRequest(
                handle.payload_id,
                self._engine.segment,
                tuple(r.ptr for r in dst),
                tuple(r.nbytes for r in dst),
            )
            reply = self._client.call(source.endpoint, req, deadline)
        finally:
            for lease_id in leases:
                self._engine.regs.release(lease_id)
        if reply.status == "ok":
            return
        if reply.status == "consumed":
            raise AlreadyConsumedError(reply.detail)
        if reply.status == "gone":
            raise PayloadGoneError(reply.detail)
        if reply.status == "mismatch":
            raise DestinationMismatchError(reply.detail)
        raise TransferError(f"producer {source.endpoint}: {reply.detail}")

    # both --------------------------------------------------------------------
    def pin(self, region: Region) -> None:
        self._engine.regs.pin(region)

    def unpin(self, region: Region) -> None:
        self._engine.regs.unpin(region)

    def registered(self) -> tuple[int, int, int]:
        return self._engine.regs.count, self._engine.regs.nbytes, self._engine.regs.temporary

    def holds(self, payload_id: str) -> bool:
        """Whether this producer still holds ``payload_id`` for a consumer."""
        with self._lock:
            return payload_id in self._held

    def close(self) -> None:
        self._client.close()
        if self._server is not None:
            self._server.close()
        with self._lock:
            ids = list(self._held)
        for payload_id in ids:
            self._drop(payload_id)
        self._engine.close()

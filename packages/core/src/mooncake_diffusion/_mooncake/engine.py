"""A Transfer Engine in P2PHANDSHAKE mode (no metadata service) with typed errors.

Peers find each other by segment name ``ip:rpc_port``, which travels in handles.
Transfers block the calling thread and release the GIL inside Mooncake.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_diffusion._mooncake import import_mooncake
from mooncake_diffusion.errors import ConfigError, MooncakeError, TransferError
from mooncake_diffusion.registration import Registrations
from mooncake_diffusion.settings import MooncakeSettings

__all__ = ["Engine"]


class Engine:
    """One Transfer Engine per process role; ``close()`` when done (about 1 s)."""

    def __init__(self, settings: MooncakeSettings) -> None:
        mod = import_mooncake("engine")
        self._te = mod.TransferEngine()
        rc = self._te.initialize(
            settings.local_hostname, "P2PHANDSHAKE", settings.protocol, settings.device
        )
        if rc != 0:
            raise ConfigError(
                f"Transfer Engine failed to start on {settings.local_hostname} "
                f"(protocol {settings.protocol!r}, device {settings.device!r}): {rc}"
            )
        self.segment = f"{settings.local_hostname}:{self._te.get_rpc_port()}"
        self.regs = Registrations(self._register, self._unregister)

    def _register(self, ptr: int, nbytes: int, device: str) -> None:
        location = "*" if device == "cpu" else device
        rc = self._te.register_memory(ptr, nbytes, location)
        if rc != 0:
            raise MooncakeError(f"Transfer Engine register_memory of {nbytes} bytes: {rc}", rc)

    def _unregister(self, ptr: int) -> None:
        rc = self._te.unregister_memory(ptr)
        if rc != 0:
            raise MooncakeError(f"Transfer Engine unregister_memory: {rc}", rc)

    def write(
        self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Write local registered ``src[i]`` into ``peer``'s registered ``dst[i]``.

        One range goes through ``transfer_sync_write`` (no batch bookkeeping,
        measurably cheaper here), several through ``batch_transfer_sync_write``.
        """
        if not src:
            return
        if len(src) == 1:
            rc = self._te.transfer_sync_write(peer, src[0], dst[0], lengths[0])
        else:
            rc = self._te.batch_transfer_sync_write(peer, list(src), list(dst), list(lengths))
        if rc != 0:
            raise TransferError(
                f"Transfer Engine write of {sum(lengths)} bytes to {peer} failed ({rc}): "
                "peer unreachable or destination not registered there"
            )

    def close(self) -> None:
        """Unregister everything and destroy the engine. Idempotent."""
        if self._te is None:
            return
        self.regs.close()
        self._te = None

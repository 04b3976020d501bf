"""sglang's diffusion ``BaseTransferEngine``, backed by ``mooncake_diffusion.handoff.direct``.

sglang 0.5.23 (``multimodal_gen/runtime/disaggregation/transport/engine.py``)
calls, per scheduler process (rank 0 of a role):

    engine = create_transfer_engine(hostname, gpu_id, ib_device)   # the plugin's hook
    engine.supports_gpu_direct     # picks the staging pool: GPU memory or host
    engine.register_buffer(pool_ptr, pool_size)     # DiffusionTransferManager, once
    engine.session_id              # sent to the DiffusionServer, then to senders
    engine.transfer_sync(dst_session_id, src, dst, n)   # sender push thread, per request
    engine.deregister_buffer(pool_ptr)              # DiffusionTransferManager.cleanup

Every call maps onto core; nothing here moves bytes itself. Failures come back
as sglang expects them, a negative return code, and are logged with the
reason (and kept in ``last_error``): ``-2`` destination outside the peer's
registered memory, ``-3`` peer unreachable, ``-4`` deadline passed, ``-1`` any
other failure.
"""

from __future__ import annotations

import logging
import os

from sglang.multimodal_gen.runtime.disaggregation.transport.engine import BaseTransferEngine

from mooncake_diffusion.errors import DeadlineExceededError, MooncakeDiffusionError, PeerGoneError
from mooncake_diffusion.handoff.direct import (
    DirectEngine,
    DirectStats,
    RetryPolicy,
    UnregisteredDestinationError,
)
from mooncake_diffusion.platform.deployment import inspect_build
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion_sglang.options import Options

__all__ = ["MooncakeDiffusionTransferEngine", "resolve_pool"]

logger = logging.getLogger(__name__)

_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UnregisteredDestinationError, -2),
    (PeerGoneError, -3),
    (DeadlineExceededError, -4),
)


def _cuda_mooncake() -> bool:
    """Whether the installed Mooncake can register GPU memory: read from what its
    native modules link against (any CUDA major, any distribution name)."""
    build = inspect_build()
    return build is not None and build.device_memory


def resolve_pool(options: Options) -> str:
    """``host`` or ``device``: where sglang's staging pool lives for these options."""
    if options.pool != "auto":
        return options.pool
    import torch

    return "device" if torch.cuda.is_available() and _cuda_mooncake() else "host"


class MooncakeDiffusionTransferEngine(BaseTransferEngine):
    """One per sglang role process; ``close()`` (or process exit) ends it.

    ``hostname`` is sglang's ``--disagg-p2p-hostname`` (what peers dial),
    ``ib_device`` its ``--disagg-ib-device``; ``options`` default to what the
    serve process exported (``Options.from_env``).
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        gpu_id: int = 0,
        ib_device: str | None = None,
        options: Options | None = None,
    ) -> None:
        self.options = options or Options.from_env()
        opts = self.options
        protocol = opts.protocol
        if protocol == "auto":
            protocol = "rdma" if ib_device and os.environ.get("MC_FORCE_TCP") != "1" else "tcp"
        self.pool = resolve_pool(opts)
        settings = MooncakeSettings(
            local_hostname=hostname,
            protocol=protocol,
            device=ib_device or "",
            same_host=opts.same_host == "auto",
        )
        retry = RetryPolicy(attempts=opts.retries, timeout_s=opts.timeout_s)
        device = f"cuda:{gpu_id}" if self.pool == "device" else "cpu"
        self._core = DirectEngine(settings, retry=retry, device=device)
        self.last_error: MooncakeDiffusionError | None = None
        logger.info(
            "mooncake-diffusion transfer engine on %s (protocol %s, pool %s, same-host %s)",
            self._core.segment,
            protocol,
            self.pool,
            opts.same_host,
        )

    @property
    def supports_gpu_direct(self) -> bool:
        """True when the staging pool should be GPU memory (``pool: device``)."""
        return self.pool == "device"

    @property
    def session_id(self) -> str:
        """``host:port|mcd1|...``: the Transfer Engine segment plus what same-host
        senders need; read after ``register_buffer`` (sglang does)."""
        return self._core.session

    def register_buffer(self, ptr: int, length: int) -> None:
        """Register sglang's staging pool once; raises on an overlapping range."""
        self._core.register(ptr, length)

    def deregister_buffer(self, ptr: int) -> None:
        self._core.unregister(ptr)

    def transfer_sync(self, dst_session_id: str, src_addr: int, dst_addr: int, length: int) -> int:
        """Push ``length`` bytes into the peer; 0 on success, negative on failure."""
        return self.batch_transfer_sync(dst_session_id, [src_addr], [dst_addr], [length])

    def batch_transfer_sync(
        self,
        dst_session_id: str,
        src_addrs: list[int],
        dst_addrs: list[int],
        lengths: list[int],
    ) -> int:
        """Push every range (one batch); 0 on success, negative on failure (logged)."""
        try:
            self._core.write(dst_session_id, src_addrs, dst_addrs, lengths)
        except MooncakeDiffusionError as e:
            self.last_error = e
            code = next((c for cls, c in _CODES if isinstance(e, cls)), -1)
            logger.error("mooncake-diffusion transfer failed (%d): %s", code, e)
            return code
        return 0

    def stats(self) -> DirectStats:
        """Transfer counters: writes, bytes and seconds by path, retries, failures."""
        return self._core.stats()

    def close(self) -> None:
        """Unregister everything and stop the Transfer Engine. Idempotent."""
        self._core.close()

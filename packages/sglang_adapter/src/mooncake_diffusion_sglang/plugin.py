"""The ``sglang.multimodal_gen.plugins`` entry point: makes the flag real.

sglang calls ``register()`` in every process that runs diffusion code (the
``sglang serve`` parent, each spawned scheduler and HTTP process:
``load_plugins()``), then applies the hooks (``apply_plugin_hooks()``). Hooks,
all on sglang 0.5.23 targets:

    AFTER  DisaggServerArgsMixin.add_disagg_cli_args   parser building, serve process
           adds ``mooncake-diffusion`` to ``--disagg-transfer-backend`` and the
           adapter's ``--mooncake-diffusion-*`` flags (``options.FLAGS``)
    AFTER  ServerArgs.from_cli_args                     after parsing, serve process
           validates the adapter's flags and exports them for workers
    AROUND create_transfer_engine                       scheduler, rank 0 of a role
           our engine when the backend is ``mooncake-diffusion``, sglang's otherwise
    AROUND TransferTensorBuffer.__init__                scheduler, after the engine
           with our backend and a host pool: the pool is a shared memfd (pinned
           with cudaHostRegister when CUDA is present) instead of torch pinned
           memory, so same-host senders can map it
    AROUND DiffusionTransferManager.push_to_peer        scheduler push thread, per request
           with our backend, a failed push fails the request at the server at
           once (``failure.report_failed_push``) instead of after
           ``--disagg-timeout``, frees the staging slot where that is safe, and
           raises so that sglang sends no ``transfer_pushed`` for it
    AROUND DiffusionServer._handle_role_error           server (head) process
           our failed push's receive slot back to the receiver; a receiver that
           is gone marked dead (``server.py``)
    AROUND DiffusionServer._transfer_dispatch_to_receiver  server process
           routes around a dead receiver, or fails the push at its sender

Unknown targets (another sglang version) are logged by sglang and left alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

from mooncake_diffusion_sglang.options import BACKEND, ENV, FLAGS, Options, OptionsError

__all__ = ["register", "selected"]

logger = logging.getLogger(__name__)

_SA = "sglang.multimodal_gen.runtime.server_args"
_TRANSPORT = "sglang.multimodal_gen.runtime.disaggregation.transport"
_DS = "sglang.multimodal_gen.runtime.disaggregation.orchestrator.DiffusionServer"
TARGETS = {
    "cli": f"{_SA}.disagg.DisaggServerArgsMixin.add_disagg_cli_args",
    "parsed": f"{_SA}.server_args.ServerArgs.from_cli_args",
    "factory": f"{_TRANSPORT}.engine.create_transfer_engine",
    "buffer": f"{_TRANSPORT}.buffer.TransferTensorBuffer.__init__",
    "push": f"{_TRANSPORT}.manager.DiffusionTransferManager.push_to_peer",
    "role_error": f"{_DS}._handle_role_error",
    "dispatch": f"{_DS}._transfer_dispatch_to_receiver",
}


def selected() -> bool:
    """Whether this process runs with ``--disagg-transfer-backend mooncake-diffusion``:
    sglang's global server args when set (schedulers), else the exported options."""
    mod = sys.modules.get(f"{_SA}.server_args")
    args = getattr(mod, "_global_server_args", None) if mod is not None else None
    if args is not None:
        return getattr(args, "disagg_transfer_backend", None) == BACKEND
    return bool(os.environ.get(ENV))


def add_cli_args(result: None, cls: type, parser: argparse.ArgumentParser) -> None:
    """Extend ``--disagg-transfer-backend``'s choices and add the adapter's flags."""
    action = parser._option_string_actions.get("--disagg-transfer-backend")
    if action is not None and action.choices is not None and BACKEND not in action.choices:
        action.choices = [*action.choices, BACKEND]
        action.help = f"{action.help} '{BACKEND}': mooncake-diffusion (adapter)."
    if "--mooncake-diffusion-config" in parser._option_string_actions:
        return
    parser.add_argument(
        "--mooncake-diffusion-config",
        default=None,
        metavar="PATH",
        help=f"YAML/JSON file with the {BACKEND} adapter's settings "
        f"(keys: {', '.join(Options.__struct_fields__)}).",
    )
    for name, (flag, kw) in FLAGS.items():
        parser.add_argument(flag, dest=f"mooncake_diffusion_{name}", default=None, **kw)


def _namespace(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("args")


def after_from_cli_args(result: Any, *args: Any, **kwargs: Any) -> None:
    """Validate the adapter's flags against the parsed server args and export them.

    Exits like sglang's own argument errors (``SystemExit`` with a message) when
    an adapter flag is given without selecting the backend, or a value is bad.
    """
    ns = _namespace(args, kwargs)
    given = [
        flag
        for name, (flag, _) in {"config": ("--mooncake-diffusion-config", {}), **FLAGS}.items()
        if getattr(ns, f"mooncake_diffusion_{name}", None) is not None
    ]
    if getattr(result, "disagg_transfer_backend", None) != BACKEND:
        os.environ.pop(ENV, None)
        if given:
            raise SystemExit(
                f"error: {', '.join(given)} need(s) --disagg-transfer-backend {BACKEND}"
            )
        return
    try:
        options = Options.from_cli(ns)
    except OptionsError as e:
        raise SystemExit(f"error: {e}") from None
    options.export()


def around_create_transfer_engine(
    original: Callable[..., Any],
    hostname: str = "127.0.0.1",
    gpu_id: int = 0,
    ib_device: str | None = None,
    **kwargs: Any,
) -> Any:
    """sglang's factory, answering with the adapter's engine when selected."""
    if not selected():
        return original(hostname=hostname, gpu_id=gpu_id, ib_device=ib_device, **kwargs)
    from mooncake_diffusion_sglang.engine import MooncakeDiffusionTransferEngine

    return MooncakeDiffusionTransferEngine(hostname=hostname, gpu_id=gpu_id, ib_device=ib_device)


def around_buffer_init(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> None:
    """With our backend, a host staging pool lives in a shared memfd.

    sglang builds its allocator and bookkeeping as usual (on a ``meta`` tensor,
    which takes no memory); then the pool memory is swapped for the memfd. It
    is released when the buffer object goes away.
    """
    device = kwargs.get("device", args[3] if len(args) > 3 else "cpu")
    if device != "cpu" or not selected():
        original(self, *args, **kwargs)
        return
    if len(args) > 3:
        args = (*args[:3], "meta", *args[4:])
    else:
        kwargs["device"] = "meta"
    original(self, *args, **kwargs)
    from mooncake_diffusion.handoff.direct import allocate_pool, release_pool

    size = self._allocator.pool_size
    pool = allocate_pool(size)
    weakref.finalize(self, release_pool, pool.base)
    self._pool = pool.tensor
    self._pool_ptr = pool.base
    self._device = "cpu"
    pinned = _pin(pool.base, size)
    logger.info(
        "TransferTensorBuffer: %d MiB shared host pool (memfd%s) for %s",
        size >> 20,
        ", cudaHostRegister" if pinned else "",
        BACKEND,
    )


def around_push_to_peer(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> bool:
    """sglang's push; with our backend, a failure is reported to the DiffusionServer
    with the engine's reason (sglang itself only logs it), the staging slot is
    freed where no byte can still be read out of it, and ``PushFailedError`` is
    raised so that sglang sends no ``transfer_pushed`` (``failure.py``). A push the
    server addressed to a receiver it knows is gone (``server.DEAD_SESSION``) is not
    attempted: it fails at once with the reason the server recorded.

    Returns True for a push that landed; raises ``PushFailedError`` for one that
    did not."""
    if not selected():
        return original(self, *args, **kwargs)
    from mooncake_diffusion.errors import PeerGoneError
    from mooncake_diffusion.handoff.direct import may_write_late
    from mooncake_diffusion_sglang.failure import PushFailedError, report_failed_push
    from mooncake_diffusion_sglang.server import dead_reason

    request_id = kwargs.get("request_id", args[0] if args else "")
    dest = kwargs.get("dest_session_id", args[1] if len(args) > 1 else "")
    gone = dead_reason(dest)
    if gone is not None:
        reason = f"{BACKEND} push of {request_id} not sent: its receiver is gone ({gone})"
        report_failed_push(request_id, reason)
        self.free_staged(request_id)
        raise PushFailedError(reason)
    engine = getattr(self, "_engine", None)
    if engine is not None:
        engine.last_error = None
    ok = original(self, *args, **kwargs)
    if ok:
        return ok
    error = getattr(engine, "last_error", None)
    peer_gone = isinstance(error, PeerGoneError)
    reason = (
        f"{BACKEND} push of {request_id} to {dest.split('|', 1)[0]} failed: "
        f"{error or 'see the sender log'}"
    )
    late = error is not None and may_write_late(error)
    report_failed_push(request_id, reason, peer_gone=peer_gone, dst_lost=late)
    if not late:  # the write returned: no reader is left on the slot (``failure.py``)
        self.free_staged(request_id)
    raise PushFailedError(reason) from error


def _pin(ptr: int, nbytes: int) -> bool:
    """Page-lock host memory for fast device copies where CUDA is present."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        ok = int(rc) == 0
    except Exception as e:  # an old or unusual CUDA runtime binding
        rc, ok = e, False
    if not ok:
        logger.warning("cudaHostRegister of the staging pool failed (%s); unpinned", rc)
    return ok


def register() -> None:
    """Entry point: register the hooks with sglang's diffusion hook registry."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType

    HookRegistry.register(TARGETS["cli"], add_cli_args, HookType.AFTER)
    HookRegistry.register(TARGETS["parsed"], after_from_cli_args, HookType.AFTER)
    HookRegistry.register(TARGETS["factory"], around_create_transfer_engine, HookType.AROUND)
    HookRegistry.register(TARGETS["buffer"], around_buffer_init, HookType.AROUND)
    HookRegistry.register(TARGETS["push"], around_push_to_peer, HookType.AROUND)
    from mooncake_diffusion_sglang.server import around_dispatch, around_role_error

    HookRegistry.register(TARGETS["role_error"], around_role_error, HookType.AROUND)
    HookRegistry.register(TARGETS["dispatch"], around_dispatch, HookType.AROUND)

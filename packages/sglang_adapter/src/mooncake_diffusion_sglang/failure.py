"""A failed push reaches the request: the role tells sglang's DiffusionServer.

sglang 0.5.23's push thread (``SchedulerDisaggMixin._rdma_push_loop``) only logs
a failed ``DiffusionTransferManager.push_to_peer`` and sends ``transfer_pushed``
anyway (the message has no status field): the receiver never gets the bytes
and the client waits for the whole ``--disagg-timeout``. sglang's own channel
for a role's failure is an error result on the role's result socket,
``{"request_id": ..., "_disagg_error": ...}`` packed with its tensor codec
(what its encoder sends when a forward fails); the DiffusionServer answers it
with ``_complete_with_error``, which fails the request at once with the reason.

``report_failed_push`` sends exactly that, from the thread that pushed, on a
socket of its own connected to the role's result endpoint. The staged slot is
left to sglang (it keeps it on failure): after a deadline the Transfer Engine
may still read it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["report_failed_push"]

logger = logging.getLogger(__name__)

_local = threading.local()


def _socket(endpoint: str) -> Any:
    """A PUSH socket to ``endpoint`` owned by the calling thread (zmq sockets are
    not thread-safe); lives as long as the thread's process."""
    sock = getattr(_local, "sockets", {}).get(endpoint)
    if sock is None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)  # deliver before a clean exit
        sock.connect(endpoint)
        _local.sockets = {**getattr(_local, "sockets", {}), endpoint: sock}
    return sock


def report_failed_push(request_id: str, reason: str) -> bool:
    """Fail ``request_id`` at the DiffusionServer with ``reason``.

    Called in a role's scheduler process after a push failed. Returns False
    (and logs) when the process has no result endpoint to tell (not a role
    scheduler), True once the message is queued for sending.
    """
    from sglang.multimodal_gen.runtime.disaggregation.transport.codec import send_tensors
    from sglang.multimodal_gen.runtime.server_args import get_global_server_args

    endpoint = getattr(get_global_server_args(), "pool_result_endpoint", None)
    if not endpoint:
        logger.error("push of %s failed (%s); no result endpoint to report it", request_id, reason)
        return False
    send_tensors(_socket(endpoint), {}, {"request_id": request_id, "_disagg_error": reason})
    logger.error("push of %s failed, request failed at the server: %s", request_id, reason)
    return True

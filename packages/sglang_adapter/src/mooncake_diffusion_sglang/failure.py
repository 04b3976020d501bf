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
socket of its own connected to the role's result endpoint, marked
``_mcd_failed_push`` (and ``_mcd_peer_gone`` when the receiver is gone,
``_mcd_dst_lost`` when the push may still write into the receive slot) for the
server-side hooks (``server.py``: the receive slot comes back unless it may still
be written, a dead receiver leaves rotation). The push hook frees the staging
slot (sglang frees it only on success) once no byte can still be read out of it.
Its fence is ``DirectEngine.write`` returning, bounded by ``timeout_s``: the
same-host paths copy in the pushing thread, so when the write raises (a receiver
stopped past the deadline, gone, or a range refused) nothing reads the slot any
more, and a receiver that resumes reads only its own pool. The one exception is
``direct.may_write_late``: a network write submitted and then failed or cut off,
which the Transfer Engine may still be reading (Mooncake cannot cancel it, and
core offers no fence for its end); that slot stays with sglang.

The hook then raises ``PushFailedError``: sglang's push thread logs it and sends
no ``transfer_pushed``. Were it sent, it would race the error report (another
socket, read by one PULL socket in no fixed order), and the server, reading
``pushed`` first, would tell the receiver ``transfer_ready``: a live receiver
would compute on a slot the failed push did not fill, or may still write.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["PushFailedError", "report_failed_push"]

logger = logging.getLogger(__name__)

_local = threading.local()


class PushFailedError(RuntimeError):
    """A push failed: raised out of ``push_to_peer`` once ``report_failed_push`` was
    called, so that sglang sends no ``transfer_pushed`` for it. Where the process has
    no result endpoint to report to (not a role scheduler) the request is then not
    failed at the server: it waits out ``--disagg-timeout``, as a lost message does,
    rather than have its receiver read a slot the push did not fill."""


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


def report_failed_push(
    request_id: str, reason: str, *, peer_gone: bool = False, dst_lost: bool = False
) -> bool:
    """Fail ``request_id`` at the DiffusionServer with ``reason``. ``dst_lost``: the
    push may still write into the receiver's slot (``direct.may_write_late``), so
    the server must not hand that slot out again.

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
    fields = {"request_id": request_id, "_disagg_error": reason, "_mcd_failed_push": True}
    if peer_gone:
        fields["_mcd_peer_gone"] = True
    if dst_lost:
        fields["_mcd_dst_lost"] = True
    send_tensors(_socket(endpoint), {}, fields)
    logger.error("push of %s failed, request failed at the server: %s", request_id, reason)
    return True

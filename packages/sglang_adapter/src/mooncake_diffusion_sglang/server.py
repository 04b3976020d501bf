"""The DiffusionServer's side of a failed push: the slot comes back, a dead peer leaves.

sglang 0.5.23's ``DiffusionServer`` (``disaggregation/orchestrator.py``), given a
role's error result, recycles the request's pre-allocated receive slot into the
*sender's* pool (``_handle_role_error`` passes the role whose socket spoke), so the
receiver's slot is never returned; and it keeps routing to a receiver whose
pushes fail because it is gone. After two requests a dead decoder has no free
pre-allocated slot left, the third takes the slow path (asks the dead decoder
for a slot) and waits out ``--disagg-timeout``.

Two hooks, acting only on errors this adapter reported (``failure.py`` marks them
with ``_mcd_failed_push``; sglang's own backend is left alone):

    AROUND DiffusionServer._handle_role_error
           returns the pre-allocated slot to the receiver's pool, unless the
           push may still write into it (``_mcd_dst_lost``: a network write that
           failed or was cut off; or ``_mcd_peer_gone``): the slot then stays out
           of use, logged; with ``_mcd_peer_gone``, marks the receiver's session
           dead (with the reason)
    AROUND DiffusionServer._transfer_dispatch_to_receiver
           a request routed to a dead session goes to another receiver of the
           role with room; when there is none, it is dispatched as sglang does,
           but its push names the dead session (``DEAD_SESSION`` + reason): the
           sender's push hook fails it at once with that reason and frees its
           staging slot, through the failure path every push failure takes

A receiver that restarts registers a new session, which is not dead; the dead
one is then forgotten (at the next dispatch or failure), so the server keeps at
most one dead session per receiver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["DEAD_SESSION", "around_dispatch", "around_role_error", "dead_reason"]

logger = logging.getLogger(__name__)

#: Prefix of the destination session of a push the server knows cannot land.
DEAD_SESSION = "mcd-dead|"
_ATTR = "_mcd_dead_sessions"


def _dead(server: Any) -> dict[str, str]:
    """The server's dead sessions (session -> reason), only those a receiver still
    has registered: one that restarted registered a new session in its place
    (sglang's ``_handle_transfer_register`` replaces the entry), and nothing routes
    to the old one again, so it is forgotten here. At most one per receiver."""
    dead = getattr(server, _ATTR, None)
    if dead is None:
        dead = {}
        setattr(server, _ATTR, dead)
    if dead:
        live = {
            peer.get("session_id", "")
            for pool in server._pools.values()
            for peer in pool.peers.values()
        }
        for session in [s for s in dead if s not in live]:
            del dead[session]
            logger.info(
                "session %s of a dead receiver forgotten: a new session took its place",
                session.split("|", 1)[0],
            )
    return dead


def dead_reason(dest_session_id: str) -> str | None:
    """The reason carried by a push to a dead session, or ``None`` for a live one."""
    if dest_session_id.startswith(DEAD_SESSION):
        return dest_session_id[len(DEAD_SESSION) :]
    return None


def around_role_error(
    original: Callable[..., Any], self: Any, scalar_fields: dict, role: Any
) -> Any:
    """Return the receiver's pre-allocated slot, and mark a receiver that is gone."""
    if scalar_fields.get("_mcd_failed_push"):
        p2p = self._transfer_state.get(scalar_fields.get("request_id"))
        if p2p is not None and p2p.receiver_role in self._pools:
            if p2p.prealloc_slot_id is None:
                pass
            elif scalar_fields.get("_mcd_dst_lost") or scalar_fields.get("_mcd_peer_gone"):
                # a receiver found gone may only have looked gone (one refused connect):
                # its session leaves rotation below, so its slot is not needed either
                logger.warning(
                    "%s[%s] slot %s of %s stays out of use: the failed push may still "
                    "write into it",
                    p2p.receiver_role.value,
                    p2p.receiver_instance,
                    p2p.prealloc_slot_id,
                    scalar_fields.get("request_id"),
                )
                p2p.prealloc_slot_id = None  # sglang would hand it to the sender's pool
            else:
                self._recycle_prealloc_slot(p2p, p2p.receiver_role)
            if scalar_fields.get("_mcd_peer_gone"):
                peer = self._pools[p2p.receiver_role].peers.get(p2p.receiver_instance, {})
                session = peer.get("session_id", "")
                if session:
                    reason = str(scalar_fields.get("_disagg_error", ""))
                    _dead(self)[session] = reason
                    logger.error(
                        "%s[%s] (session %s) is gone; no more requests go to it: %s",
                        p2p.receiver_role.value,
                        p2p.receiver_instance,
                        session.split("|", 1)[0],
                        reason,
                    )
    return original(self, scalar_fields, role)


def around_dispatch(
    original: Callable[..., Any],
    self: Any,
    request_id: str,
    p2p: Any,
    receiver_idx: int,
    role: Any,
) -> Any:
    """Route around a dead receiver; with none left, fail the push at its sender."""
    dead = _dead(self)
    pool = self._pools[role]
    session = pool.peers.get(receiver_idx, {}).get("session_id", "")
    if not dead or session not in dead:
        return original(self, request_id, p2p, receiver_idx, role)
    for idx, room in enumerate(pool.free_slots):
        if room > 0 and pool.peers.get(idx, {}).get("session_id", "") not in dead:
            return original(self, request_id, p2p, idx, role)
    real = pool.peers.get(receiver_idx)
    pool.peers[receiver_idx] = {  # sglang's fast path, pushing to the dead session
        **(real or {}),
        "session_id": DEAD_SESSION + dead[session],
        "free_preallocated_slots": [{"offset": 0, "size": p2p.data_size, "addr": 0}],
    }
    try:
        return original(self, request_id, p2p, receiver_idx, role)
    finally:
        if real is None:
            pool.peers.pop(receiver_idx, None)
        else:
            pool.peers[receiver_idx] = real

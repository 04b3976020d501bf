"""Mooncake return codes -> typed exceptions (see ``errors.py`` for the tree)."""

from __future__ import annotations

from mooncake_diffusion.errors import (
    LeasedError,
    MooncakeError,
    PayloadGoneError,
    PeerGoneError,
    StoreFullError,
    TransientStoreError,
)

NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

#: Results a repeat of the same call clears (``StoreClient`` retries them until the
#: call's deadline): a read that outlived its lease, a failed or timed-out master RPC.
TRANSIENT = frozenset({LEASE_EXPIRED, RPC_FAIL, RPC_TIMEOUT})

_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}


def error_for(code: int, what: str) -> Exception:
    """The exception for a negative Mooncake ``code`` returned by operation ``what``."""
    name = _NAMES.get(code, "error")
    msg = f"{what} failed: Mooncake {name} ({code})"
    if code == NO_AVAILABLE_HANDLE:
        return StoreFullError(f"{msg}: the store pool is full")
    if code == OBJECT_NOT_FOUND:
        return PayloadGoneError(f"{msg}: no such object (never stored, consumed or evicted)")
    if code == OBJECT_HAS_LEASE:
        return LeasedError(f"{msg}: a reader holds a lease on the object")
    if code == TRANSFER_FAIL:
        return PeerGoneError(f"{msg}: the process holding the bytes is unreachable")
    if code == REPLICA_NOT_READY:
        return LeasedError(f"{msg}: the object is still being written")
    if code == LEASE_EXPIRED:
        return TransientStoreError(f"{msg}: the read outlived the object's lease")
    if code in TRANSIENT:
        return TransientStoreError(msg)
    return MooncakeError(msg, code)


def check(code: int, what: str) -> int:
    """Return ``code`` when it is not negative, else raise ``error_for(code, what)``."""
    if code < 0:
        raise error_for(code, what)
    return code

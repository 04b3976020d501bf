"""The one exception tree of mooncake-diffusion.

Mooncake reports failures as negative integers; the wrappers in
``mooncake_diffusion._mooncake`` turn them into these classes at the lowest
boundary, so no caller above them ever sees a raw code such as ``-706``.

    MooncakeDiffusionError
    ├── ConfigError                 bad settings or an unusable environment
    ├── PayloadError  (ValueError)  bad input to publish()/consume(); nothing was sent
    │   ├── DestinationMismatchError  dst dtype/shape/size does not match the handle
    │   └── DuplicatePublishError     (request_id, kind) already published and live
    ├── HandleError   (ValueError)  a corrupt, foreign or unknown-version handle
    ├── PayloadGoneError            the payload is not there (any more)       [cache miss]
    │   ├── AlreadyConsumedError      a delete-on-consume payload was consumed before
    │   └── LeaseLapsedError          a reader's lease lapsed before it confirmed   [retryable]
    ├── MasterUnavailableError      no healthy mooncake_master at the address  [retryable]
    ├── TransferError               bytes did not move                          [retryable]
    │   ├── PeerGoneError             the producer or store host is unreachable  [retryable]
    │   └── TransientStoreError       a read outlived its lease (-707), or a master
    │                                 RPC failed or timed out (-900/-901)       [retryable]
    ├── StoreFullError              the store pool has no room (-200)           [retryable]
    ├── LeasedError                 leased by a reader (-706) or mid-put (-703) [retryable]
    ├── DeadlineExceededError (TimeoutError)  a wait ran past its deadline      [retryable]
    ├── MooncakeError               any other Mooncake failure, with its code
    │   (defined beside their subsystems, same base:)
    ├── caches.CacheKeyError (PayloadError)       a value that cannot be part of a key
    ├── caches.CacheMismatchError (PayloadError)  a key or entry of another encoder/model
    ├── caches.CacheEntryError (HandleError)      corrupt or foreign cache metadata
    └── orchestrator.OrchestratorError            bad orchestrator config, policy or clock
        └── orchestrator.JournalError             an unreadable, foreign or failing journal

``retryable`` is a class attribute: ``True`` means the same call may succeed
later without changing its input. ``TransientStoreError`` is already retried by
the Store wrapper until the operation's deadline; seeing it means the deadline
passed with the fault still there. ``PayloadGoneError`` means "treat as a cache
miss": recompute or re-publish.
"""

from __future__ import annotations

__all__ = [
    "AlreadyConsumedError",
    "ConfigError",
    "DeadlineExceededError",
    "DestinationMismatchError",
    "DuplicatePublishError",
    "HandleError",
    "LeaseLapsedError",
    "LeasedError",
    "MasterUnavailableError",
    "MooncakeDiffusionError",
    "MooncakeError",
    "PayloadError",
    "PayloadGoneError",
    "PeerGoneError",
    "StoreFullError",
    "TransferError",
    "TransientStoreError",
]


class MooncakeDiffusionError(Exception):
    """Base of every error this package raises on purpose."""

    retryable: bool = False


class ConfigError(MooncakeDiffusionError):
    """Settings are invalid, or a required native package is missing."""


class PayloadError(MooncakeDiffusionError, ValueError):
    """The caller's input is unusable; nothing was published or consumed."""


class DestinationMismatchError(PayloadError):
    """A destination tensor does not match the handle's dtype, shape or size."""


class DuplicatePublishError(PayloadError):
    """The same (request_id, kind) is already published by this connector and still live."""


class HandleError(MooncakeDiffusionError, ValueError):
    """A handle could not be decoded: corrupt bytes, a foreign object or an unknown version."""


class PayloadGoneError(MooncakeDiffusionError):
    """The payload's bytes are not there: never published, expired, evicted or removed."""


class AlreadyConsumedError(PayloadGoneError):
    """A delete-on-consume payload was already consumed once."""


class LeaseLapsedError(PayloadGoneError):
    """A keyed receive fetched the bytes but its lease lapsed before it could confirm:
    nothing was delivered to it, and the record stays for the next receive."""

    retryable = True


class MasterUnavailableError(MooncakeDiffusionError):
    """No healthy mooncake_master answers at the configured address."""

    retryable = True


class TransferError(MooncakeDiffusionError):
    """The Transfer Engine or the Store failed to move bytes."""

    retryable = True


class PeerGoneError(TransferError):
    """The producer, consumer or store host process is unreachable or died."""


class TransientStoreError(TransferError):
    """A Store call hit a fault that a repeat of the same call clears: the object's read
    lease ran out mid-transfer (Mooncake -707, the bytes cannot be trusted), or the
    master RPC failed or timed out (-900/-901). ``StoreClient`` retries these within
    the call's deadline; this surfaces only when the deadline passed."""


class StoreFullError(MooncakeDiffusionError):
    """The store pool has no room for the object (Mooncake -200)."""

    retryable = True


class LeasedError(MooncakeDiffusionError):
    """The object holds a read lease and cannot be removed without force (Mooncake -706)."""

    retryable = True


class DeadlineExceededError(MooncakeDiffusionError, TimeoutError):
    """A bounded wait ran past its deadline."""

    retryable = True


class MooncakeError(MooncakeDiffusionError):
    """A Mooncake call failed with a code that has no more specific class."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code

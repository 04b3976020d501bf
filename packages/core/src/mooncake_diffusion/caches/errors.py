"""The errors of the caches, placed in the package's tree (``mooncake_diffusion.errors``):

    PayloadError (ValueError)
    ├── CacheKeyError        the inputs cannot form a key: NaN, a non-JSON value,
    │                        an integer beyond 2**53, a lone surrogate, a malformed key
    └── CacheMismatchError   a key or a stored entry belongs to another encoder
                             (id or version) or model than the cache asking
    HandleError (ValueError)
    └── CacheEntryError      a metadata object is corrupt, of an unknown format
                             version, or inconsistent with its data

None is retryable: the same call fails the same way. A cache never writes
anything before its input has passed every check, so none of these leaves a
partial entry in the store.
"""

from __future__ import annotations

from mooncake_diffusion.errors import HandleError, PayloadError

__all__ = ["CacheEntryError", "CacheKeyError", "CacheMismatchError"]


class CacheKeyError(PayloadError):
    """The fields given for a cache key cannot be encoded canonically."""


class CacheMismatchError(PayloadError):
    """A key or entry belongs to another encoder id/version (or CFG model) than this cache."""


class CacheEntryError(HandleError):
    """A stored metadata object is corrupt, foreign or of an unknown format version."""

"""One value per key, shared by every holder of the key and forgotten with the last.

    labels = Interned[tuple, dict]()
    shared = labels.hold(key, candidate)   # a worker joins: the key's value
    labels.drop(key)                       # it leaves: the last one takes the value

The scheduling core keeps a fleet's per-worker state small by sharing what many
workers have alike (a label set, the buckets of a set of routing groups): one
shared object stays in the CPU's cache where one per worker of a fleet of
thousands is a miss per decision. Counting holders lets a value go with its last
holder, so a group or label set the fleet no longer has is not kept alive.
Registration-time only; not thread-safe (the core is single-threaded).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Interned"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Interned(Generic[K, V]):
    """Values by key, each with a count of its holders."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[K, tuple[V, int]] = {}

    def hold(self, key: K, value: V) -> V:
        """One more holder of ``key``; returns the key's shared value: ``value`` if the
        key is new, else the one its first holder gave (``value`` is then unused).
        The value is every holder's: a change one makes, all see (the core's label
        dicts are read-only; index lanes are filled in by whichever worker first
        needs a key, for all of them)."""
        got = self._held.get(key)
        if got is None:
            self._held[key] = (value, 1)
            return value
        self._held[key] = (got[0], got[1] + 1)
        return got[0]

    def drop(self, key: K) -> None:
        """A holder of ``key`` let go (it must hold it); the last one takes the value."""
        value, n = self._held[key]
        if n > 1:
            self._held[key] = (value, n - 1)
        else:
            del self._held[key]

    def holders(self, key: K) -> int:
        """How many hold ``key`` (0: none; its value is forgotten)."""
        got = self._held.get(key)
        return 0 if got is None else got[1]

    def values(self) -> list[V]:
        """The values held now, in the order their keys were first held."""
        return [v for v, _ in self._held.values()]

    def __len__(self) -> int:
        return len(self._held)

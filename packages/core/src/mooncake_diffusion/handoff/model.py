"""A model of Mooncake Store for the mailbox protocol: its operations with the
real store's semantics, in memory, answered one at a time.

The tests' explorer drives ``handoff.protocol`` against it through every
interleaving and crash point; ``tests/integration/test_mailbox_protocol.py``
runs the same operation sequences against a real master and store host and
checks that both answer alike. What it models (``protocol``'s contract):

- ``Put`` never overwrites and answers ``OK`` for a key that exists; a key
  that does not fit (``capacity`` keys at most, counting every key) answers
  ``FULL`` and is not stored.
- ``Remove`` answers ``True`` for exactly one remover of a key.
- ``now_ms`` is the clock every party reads (``Now``); the explorer moves it.
- ``sweep`` is a reaper's pass: every expiry marker whose time has come goes
  with the key it names (``leases``' marker format).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from mooncake_diffusion.handoff.protocol import FULL, OK, Exists, Get, Now, Op, Pause, Put, Remove
from mooncake_diffusion.transfer.leases import expired_keys

__all__ = ["ModelStore"]


@dataclass
class ModelStore:
    """The store's keys and bytes, a clock, and a capacity in keys (``None``: no
    limit). ``apply`` answers one operation; ``steps`` splits a batch into the
    single-key operations that other parties' operations may land between."""

    capacity: int | None = None
    now_ms: int = 1_000_000
    keys: dict[str, bytes] = field(default_factory=dict)

    def apply(self, op: Op) -> object:
        """The answer to ``op``, changing the store as the real one would."""
        if isinstance(op, Put):
            return tuple(self._put(k, v) for k, v in op.items)
        if isinstance(op, Get):
            return self.keys.get(op.key)
        if isinstance(op, Exists):
            return tuple(k in self.keys for k in op.keys)
        if isinstance(op, Remove):
            return tuple(self.keys.pop(k, None) is not None for k in op.keys)
        if isinstance(op, Now):
            return self.now_ms
        if isinstance(op, Pause):
            return None
        raise TypeError(f"not a store operation: {op!r}")

    def steps(self, op: Op) -> Iterator[Op]:
        """``op`` as the operations of one key each, in order: another client's
        operation may land between two keys of a batched remove or existence check.
        A batched put stays whole: Mooncake's master places every key of one
        ``BatchPutStart`` in one request, so room cannot come or go between them."""
        if isinstance(op, Exists | Remove):
            for k in op.keys:
                yield type(op)((k,))
        else:
            yield op

    def _put(self, key: str, value: bytes) -> int:
        if key in self.keys:
            return OK
        if self.capacity is not None and len(self.keys) >= self.capacity:
            return FULL
        self.keys[key] = value
        return OK

    def sweep(self) -> int:
        """Remove every expired marker and the key it names; returns how many keys went."""
        doomed = expired_keys(list(self.keys), self.now_ms / 1000)
        return sum(self.keys.pop(k, None) is not None for k in doomed)

    def snapshot(self) -> tuple[tuple[str, bytes], ...]:
        """The store's contents, sorted (a state the explorer can compare)."""
        return tuple(sorted(self.keys.items()))

"""A Mooncake Store client with typed errors and register-once buffers.

One ``StoreClient`` per process role: a pure client (``segment_bytes=0``) in
producers and consumers, a segment owner in the store host. Calls block and
release the GIL inside Mooncake; the client is safe to share between threads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mooncake_diffusion._mooncake import import_mooncake
from mooncake_diffusion._mooncake.codes import (
    OBJECT_NOT_FOUND,
    REPLICA_NOT_READY,
    check,
    error_for,
)
from mooncake_diffusion._mooncake.master import probe_master
from mooncake_diffusion.errors import MasterUnavailableError
from mooncake_diffusion.registration import Registrations
from mooncake_diffusion.settings import MooncakeSettings

__all__ = ["StoreClient"]


class StoreClient:
    """Connects at construction (probing the master first; fails within
    ``settings.connect_timeout_s`` if it is not there); ``close()`` when done."""

    def __init__(self, settings: MooncakeSettings, *, segment_bytes: int = 0) -> None:
        self._mod = import_mooncake("store")
        probe_master(settings)
        self._store = self._mod.MooncakeDistributedStore()
        rc = self._store.setup(
            settings.local_hostname,
            "P2PHANDSHAKE",
            segment_bytes,
            0,
            settings.protocol,
            settings.device,
            settings.master,
        )
        if rc != 0:
            raise MasterUnavailableError(
                f"Mooncake Store setup against master {settings.master} failed ({rc})"
            )
        self.regs = Registrations(self._register, self._unregister)
        self._closed = False

    def _register(self, ptr: int, nbytes: int, device: str) -> None:
        check(self._store.register_buffer(ptr, nbytes), "store register_buffer")

    def _unregister(self, ptr: int) -> None:
        check(self._store.unregister_buffer(ptr), "store unregister_buffer")

    def _config(self, pin: str) -> object:
        cfg = self._mod.ReplicateConfig()
        if pin == "hard":
            cfg.with_hard_pin = True
        elif pin == "soft":
            if hasattr(cfg, "soft_pin_action"):  # Mooncake >= 0.3.13
                cfg.soft_pin_action = self._mod.SoftPinAction.ENABLE
            else:
                cfg.with_soft_pin = True
        return cfg

    def put_many(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        pin: str,
    ) -> None:
        """Store under ``keys[i]`` the bytes of registered buffers ``ptrs[i]`` (sizes
        ``sizes[i]``), gathered in order into one object; all or nothing.

        ``pin`` is ``"hard"`` (never evicted), ``"soft"`` (evicted last) or
        ``"none"``. On any failure the keys that did land are removed and the
        first error is raised (``StoreFullError`` when the pool is full).
        """
        if not keys:
            return
        codes = self._store.batch_put_from_multi_buffers(
            list(keys), [list(p) for p in ptrs], [list(n) for n in sizes], self._config(pin)
        )
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if failed:
            self.remove_many([k for k, c in zip(keys, codes, strict=True) if c >= 0])
            key, code = failed[0]
            raise error_for(code, f"store put of {key!r}")

    def get_many(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> list[bool]:
        """Read each key, scattered in order into registered buffers ``ptrs[i]``
        (sizes ``sizes[i]``); ``False`` where the key is absent or still being put.

        Any other failure raises (``PeerGoneError`` when the store host died).
        """
        if not keys:
            return []
        codes = self._store.batch_get_into_multi_buffers(
            list(keys), [list(p) for p in ptrs], [list(n) for n in sizes]
        )
        found = []
        for key, code in zip(keys, codes, strict=True):
            if code in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
                found.append(False)
            else:
                check(code, f"store get of {key!r}")
                found.append(True)
        return found

    def read(self, key: str, ptr: int, capacity: int) -> int | None:
        """Read object ``key`` of unknown size into registered memory at ``ptr`` that
        holds ``capacity`` bytes; returns its size, or ``None`` when the key is absent
        or still being put. An object larger than ``capacity`` raises ``MooncakeError``;
        any other failure raises as in ``get_many``. One round trip, no size query."""
        code = self._store.get_into(key, ptr, capacity)
        if code in (OBJECT_NOT_FOUND, REPLICA_NOT_READY):
            return None
        return check(code, f"store read of {key!r}")

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in the store (one round trip); any failure raises."""
        if not keys:
            return []
        found = []
        for key, code in zip(keys, self._store.batch_is_exist(list(keys)), strict=True):
            found.append(check(code, f"store existence check of {key!r}") == 1)
        return found

    def remove_many(self, keys: Sequence[str]) -> None:
        """Remove keys with force (leases granted by reads do not block); absent keys
        are fine."""
        if not keys:
            return
        for key, code in zip(keys, self._store.batch_remove(list(keys), True), strict=True):
            if code < 0 and code != OBJECT_NOT_FOUND:
                raise error_for(code, f"store remove of {key!r}")

    def claim(self, key: str) -> bool:
        """Remove ``key`` with force and say whether this call removed it: ``True`` for
        exactly one of any number of callers racing on one key (the master removes an
        object once; the others get OBJECT_NOT_FOUND), ``False`` when it was absent."""
        code = self._store.batch_remove([key], True)[0]
        if code == OBJECT_NOT_FOUND:
            return False
        check(code, f"store remove of {key!r}")
        return True

    def remove_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix`` (with force); returns how many."""
        return self.remove_regex("^" + re.escape(prefix))

    def remove_regex(self, pattern: str) -> int:
        """Remove every key matching the regular expression ``pattern`` (with force;
        one scan of the master's keys); returns how many."""
        return max(self._store.remove_by_regex(pattern, True), 0)

    def close(self) -> None:
        """Unregister buffers and disconnect (about 1 s inside Mooncake). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.regs.close()
        self._store.close()

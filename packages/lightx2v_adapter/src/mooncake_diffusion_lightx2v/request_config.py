"""A request's settings on a runner's config, never outliving the request.

LightX2V's server applies each request with ``runner.set_config(task)``, a
``config.update`` that keeps every key the request set; Qwen's
``apply_disagg_request_overrides`` also writes the request's rooms into
``disagg_config``. So the next request inherits them: one client's
``resize_mode`` reshapes another's video, and a request without a room reads
the previous request's room (a silent payload swap).

``RoleConfig`` remembers the role's own config at the first request and puts
it back, in place, before each later one (and, in queue mode, after each
item): keys a request added are removed, values it changed restored, nested
dicts (``disagg_config``) included, each at its original identity (LightX2V's
scheduler and the adapter hold references to them). ``install`` wraps a
runner's ``set_config`` so LightX2V's own server path gets this too.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from typing import Any

__all__ = ["RoleConfig"]

#: a dict as it was: (the object, its items, each nested dict's as it was)
_Snapshot = tuple[dict, dict[str, Any], dict[str, "_Snapshot"]]
_MISSING = object()


def _snapshot(d: dict) -> _Snapshot:
    items = dict(d.items())
    return d, items, {k: _snapshot(v) for k, v in items.items() if isinstance(v, dict)}


def _restore(snap: _Snapshot) -> None:
    d, items, nested = snap
    # dict's own methods: LightX2V's LockableDict would re-wrap the original objects
    # (and refuse while locked); this puts back the state it had, not a new write
    for key in [k for k in d if k not in items]:
        dict.__delitem__(d, key)
    for key, value in items.items():
        if dict.get(d, key, _MISSING) is not value:
            dict.__setitem__(d, key, value)
    for sub in nested.values():
        _restore(sub)


class RoleConfig:
    """The role's own config of ``runner``, restorable after any request."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._own: _Snapshot | None = None

    def remember(self) -> None:
        """Take the role's own config as it is now (once; later calls do nothing)."""
        if self._own is None:
            self._own = _snapshot(self.runner.config)

    def restore(self) -> None:
        """Put the role's own config back (nothing before ``remember``)."""
        if self._own is not None:
            _restore(self._own)

    def for_request(self, settings: Mapping[str, Any]) -> Mapping[str, Any]:
        """The config one request runs with, read-only, without touching the runner's
        (queue mode reads it to receive an item's input while another item runs)."""
        own = self._own[1] if self._own is not None else self.runner.config
        return ChainMap(dict(settings), own)

    def install(self) -> None:
        """Wrap this runner's ``set_config`` (on the instance, so a runner class's
        own override, e.g. Qwen's, runs inside): the role's own config first, then
        the request's settings on it."""
        original = self.runner.set_config

        def set_config(config_modify: Any) -> Any:
            self.remember()
            self.restore()
            return original(config_modify)

        set_config.__wrapped__ = original  # type: ignore[attr-defined]
        self.runner.set_config = set_config

"""The ``lightx2v.platform_plugins`` entry point: routes DisaggMixin through the adapter.

Sequence:
    import lightx2v
      -> lightx2v_platform.set_ai_device._load_platform_plugins()
         -> register()                  (this module; a zero-arg callable)
            -> patch(DisaggMixin) now, if lightx2v.disagg.disagg_mixin is loaded,
               else once it finishes loading (a one-shot import hook)
    runner.init_disagg(config) ...      each patched method checks the runner's
                                        config and calls the adapter or LightX2V

Why the hook: plugins run before ``init_ai_device``, and disagg_mixin binds
``AI_DEVICE`` at import (``from ... import AI_DEVICE``). Importing it from
here would freeze ``AI_DEVICE`` at ``None``; so this module imports nothing of
LightX2V and patches the class right after LightX2V itself imports it.

Routing: ``init_disagg(config)`` decides by its ``config`` argument, the other
five by ``self.config``: ``disagg_config.transfer_backend == "mooncake_diffusion"``
goes to ``runner.py``; anything else calls LightX2V's original, unchanged.
``patch`` is idempotent; ``unpatch`` restores the originals.

Failing loudly: LightX2V only logs a plugin that fails to load, and its own
``init_disagg`` ignores ``transfer_backend``, so a role configured for
``mooncake_diffusion`` would silently run LightX2V's built-in transfer. This
module therefore imports only the standard library at load time; ``register``
imports the adapter (and with it core and Mooncake) itself, and when that
fails it still patches ``init_disagg``, so that such a role raises at start-up
naming the cause (other roles are untouched). Only a failure to import this
very module (the package not installed, a broken Python path) cannot be
caught: no code of the adapter runs then.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from mooncake_diffusion_lightx2v.selection import BACKEND, selects_adapter

__all__ = [
    "MIXIN_MODULE",
    "PATCHED",
    "AdapterNotActiveError",
    "patch",
    "patched",
    "register",
    "unpatch",
]

#: Where LightX2V defines ``DisaggMixin`` (f8aee98b).
MIXIN_MODULE = "lightx2v.disagg.disagg_mixin"
#: The DisaggMixin methods this plugin routes (the tests pin a stand-in to exactly these).
PATCHED = (
    "init_disagg",
    "send_encoder_outputs",
    "receive_encoder_outputs",
    "send_transformer_outputs",
    "receive_transformer_outputs",
    "release_disagg",
)
_MARK = "__mooncake_diffusion_original__"


#: Why the adapter could not be imported by ``register`` (``None``: it was).
load_error: str | None = None


class AdapterNotActiveError(RuntimeError):
    """A role selects ``mooncake_diffusion`` but the adapter failed to load."""


def _refuse(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AdapterNotActiveError(
            f"[Disagg] disagg_config.transfer_backend is {BACKEND!r} but the "
            f"mooncake_diffusion LightX2V adapter failed to load ({load_error}); "
            "refusing to fall back to LightX2V's built-in transfer"
        )

    return refuse


def _route(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    if load_error is None:
        from mooncake_diffusion_lightx2v import runner

        ours = getattr(runner, name)
    else:
        ours = _refuse(name)

    if name == "init_disagg":

        @functools.wraps(original)
        def init_disagg(self: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
            if selects_adapter(config):
                return ours(self, config, *args, **kwargs)
            return original(self, config, *args, **kwargs)

        routed = init_disagg
    elif name == "release_disagg":

        @functools.wraps(original)
        def release_disagg(self: Any, *args: Any, **kwargs: Any) -> Any:
            # by state, not config: release what init_disagg made, whatever config says now
            if getattr(self, "_mcd", None) is not None:
                return ours(self, *args, **kwargs)
            return original(self, *args, **kwargs)

        routed = release_disagg
    else:

        @functools.wraps(original)
        def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
            if selects_adapter(getattr(self, "config", None)):
                return ours(self, *args, **kwargs)
            return original(self, *args, **kwargs)

    setattr(routed, _MARK, original)
    return routed


def patch(mixin: type, names: Sequence[str] = PATCHED) -> None:
    """Route ``names`` of ``mixin`` (LightX2V's DisaggMixin) through the adapter.
    Raises ``AttributeError`` naming any method the class lacks (a LightX2V
    version this adapter does not know). Idempotent."""
    missing = [n for n in names if not callable(getattr(mixin, n, None))]
    if missing:
        raise AttributeError(
            f"{mixin.__qualname__} has no {', '.join(missing)}: not the LightX2V "
            "runner surface this adapter targets (f8aee98b)"
        )
    for name in names:
        current = mixin.__dict__.get(name, getattr(mixin, name))
        if hasattr(current, _MARK):
            continue
        setattr(mixin, name, _route(name, current))


def unpatch(mixin: type) -> None:
    """Restore LightX2V's methods on ``mixin``."""
    for name in PATCHED:
        current = mixin.__dict__.get(name)
        if current is not None and hasattr(current, _MARK):
            setattr(mixin, name, getattr(current, _MARK))


def patched(mixin: type) -> list[str]:
    """The names of ``mixin``'s methods currently routed by this plugin."""
    return [n for n in PATCHED if hasattr(mixin.__dict__.get(n), _MARK)]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``MIXIN_MODULE`` so that the
    class is patched the moment the module has executed. Removes itself."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != MIXIN_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module.DisaggMixin)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def register() -> None:
    """The entry point LightX2V calls at ``import lightx2v``. Imports nothing of
    LightX2V; imports the adapter (a failure is kept in ``load_error`` and makes
    ``mooncake_diffusion`` roles fail at ``init_disagg``, see the module
    docstring); patches DisaggMixin now or when it is imported. Idempotent."""
    global load_error
    try:
        importlib.import_module("mooncake_diffusion_lightx2v.runner")
    except Exception as e:
        load_error = f"{type(e).__name__}: {e}"
        logging.getLogger(__name__).error("[Disagg] adapter not active: %s", load_error)
    module = sys.modules.get(MIXIN_MODULE)
    if module is not None and hasattr(module, "DisaggMixin"):
        patch(module.DisaggMixin)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())

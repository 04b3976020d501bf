"""The only code that touches ``mooncake.engine`` and ``mooncake.store``.

Everything here turns Mooncake's integer return codes into the exceptions of
``mooncake_diffusion.errors`` and imports Mooncake lazily, so
``import mooncake_diffusion`` works where Mooncake is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

from mooncake_diffusion.errors import ConfigError

__all__ = ["import_mooncake", "mooncake_dir"]

# Mooncake logs at INFO to stderr; it reads MC_LOG_LEVEL when a client starts.
# Our exceptions carry every failure; set MC_LOG_LEVEL=INFO to see its own log.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

_INSTALL_HINT = (
    "Mooncake is not installed: `pip install 'mooncake-diffusion[cpu]'` on CPU/TCP machines "
    "(needs the system library libibverbs1), or on GPU machines the build matching torch's CUDA: "
    "`pip install 'mooncake-diffusion[cuda13]'` or `[cuda12]` "
    "(`python -m mooncake_diffusion.platform.deployment extra` says which)"
)


def import_mooncake(submodule: str) -> ModuleType:
    """Import ``mooncake.<submodule>``; raises ``ImportError`` saying what to install."""
    try:
        return importlib.import_module(f"mooncake.{submodule}")
    except ImportError as e:
        if "libibverbs" in str(e):
            raise ImportError(
                f"{e}: install the system library with `apt-get install -y libibverbs1`"
            ) from e
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e


def mooncake_dir() -> str:
    """The installed ``mooncake`` package folder (holds the ``mooncake_master`` binary)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(_INSTALL_HINT)
    return next(iter(spec.submodule_search_locations))

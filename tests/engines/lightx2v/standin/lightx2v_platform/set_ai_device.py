"""Stand-in for ``lightx2v_platform.set_ai_device``: load every callable of the
``lightx2v.platform_plugins`` entry-point group, then set the device.

As in LightX2V: plugins load *before* the device is set, a failing plugin is
logged and skipped, and this runs once, at ``import lightx2v``. The device is
``$PLATFORM`` (``cpu`` here; LightX2V defaults to ``cuda`` and needs a GPU).
"""

import logging
import os
from importlib.metadata import entry_points

from lightx2v_platform.base import global_var

logger = logging.getLogger("lightx2v_platform")

LOADED_PLUGINS: list[str] = []
FAILED_PLUGINS: list[str] = []


def _load_platform_plugins() -> None:
    for ep in entry_points(group="lightx2v.platform_plugins"):
        try:
            ep.load()()
            LOADED_PLUGINS.append(ep.name)
        except Exception as e:
            FAILED_PLUGINS.append(f"{ep.name}: {e}")
            logger.warning("Failed to load platform plugin %r: %s", ep.name, e)


def set_ai_device() -> None:
    platform = os.getenv("PLATFORM", "cpu")
    _load_platform_plugins()
    global_var.PLATFORM = platform
    global_var.AI_DEVICE = platform


set_ai_device()

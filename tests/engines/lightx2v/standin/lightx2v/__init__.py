"""Stand-in for LightX2V (ModelTC/LightX2V at f8aee98b), written for these tests.

LightX2V is not on PyPI and needs CUDA; this package models only the surface
the adapter touches, with the same names and call order:

- ``import lightx2v`` runs ``lightx2v_platform.set_ai_device`` first (which
  calls the ``lightx2v.platform_plugins`` entry points, then sets ``AI_DEVICE``),
  then imports the runners (and through them ``lightx2v.disagg.disagg_mixin``).
- ``DisaggMixin`` has the six methods of LightX2V's runner seam; its bodies
  stand for LightX2V's own ZMQ/Mooncake path and only record that they ran.
- ``WanRunner`` calls them where LightX2V's ``WanRunner`` does, and computes
  deterministic tensors of LightX2V's shapes in place of the models.
- ``lightx2v.utils.set_config.set_config`` merges ``--config_json`` into the
  config (unknown keys survive); ``lightx2v.infer.init_runner`` builds a runner.
"""

import lightx2v_platform.set_ai_device  # noqa: F401  (plugins load here, before the runners)

from lightx2v.models.runners.wan import wan_runner  # noqa: F401  (as lightx2v.pipeline does)

__version__ = "0.1.0"

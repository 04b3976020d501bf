"""LightX2V disaggregation over mooncake-diffusion.

Installing this package adds a ``lightx2v.platform_plugins`` entry point
(``plugin.register``). A LightX2V role JSON with
``"disagg_config": {"transfer_backend": "mooncake_diffusion", "master": "host:port"}``
then moves its Phase 1 (Encoder -> Transformer) and Phase 2 (Transformer ->
Decoder) payloads through core's ``DiffusionConnector``; any other
``transfer_backend`` leaves LightX2V exactly as it was.

    plugin.py    the entry point and the DisaggMixin routing
    runner.py    the six routed methods
    queue_mode.py  ``disagg_config.queue``: the role as an orchestrator StageWorker
    request_config.py  a request's settings end with the request (``RoleConfig``)
    payloads.py  LightX2V's dicts <-> named tensors and meta
    config.py    disagg_config -> AdapterConfig
    check.py     ``python -m mooncake_diffusion_lightx2v.check``: verify a LightX2V checkout

Targets ModelTC/LightX2V at commit f8aee98b. Nothing here imports LightX2V at
import time.
"""

__version__ = "0.1.0"
#: The LightX2V commit whose runner surface this adapter was written against.
TARGET_COMMIT = "f8aee98b5462cca8d7288888146ebd95592bf266"

__all__ = ["TARGET_COMMIT", "__version__"]

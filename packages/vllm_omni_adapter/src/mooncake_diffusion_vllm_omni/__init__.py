"""mooncake-diffusion for vLLM-Omni: the ``MooncakeDiffusionConnector`` OmniConnector.

Installing this package is all it takes: its ``vllm.general_plugins`` entry point
registers the connector name in every vLLM process; a deploy YAML then selects it
(see README.md). Importing this package imports neither vLLM nor Mooncake.

    CONNECTOR_NAME   "MooncakeDiffusionConnector"
    register         the entry point (idempotent)
"""

from mooncake_diffusion_vllm_omni.plugin import CONNECTOR_NAME, register

__all__ = ["CONNECTOR_NAME", "register"]
__version__ = "0.1.0"

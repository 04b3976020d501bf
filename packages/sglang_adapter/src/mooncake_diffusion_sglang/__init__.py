"""mooncake-diffusion for SGLang's diffusion runtime.

    sglang serve --model-path M --disagg-role denoiser --disagg-server-addr tcp://head:P \\
      --disagg-transfer-backend mooncake-diffusion [--mooncake-diffusion-config cfg.yaml]

Modules: ``plugin`` (the ``sglang.multimodal_gen.plugins`` entry point and its
hooks), ``engine`` (sglang's ``BaseTransferEngine`` on core's ``DirectEngine``),
``options`` (the adapter's flags and config file). Importing this package
imports neither sglang nor Mooncake.
"""

from mooncake_diffusion_sglang.options import BACKEND, Options

__version__ = "0.1.0"

__all__ = ["BACKEND", "Options", "__version__"]

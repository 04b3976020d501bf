"""Disaggregated diffusion serving on Mooncake.

The public surface (pinned by ``tests/unit/test_public_api.py``):

    DiffusionConnector   publish()/consume() between stage workers
    StagePayload         what a stage publishes: named tensors of one request
    Publication          a publish in flight (handle + wait/await/release)
    ReceivedPayload      consumed tensors, as views; release() when done
    PayloadHandle        the small wire reference that travels in queues
    decode_handle        bytes -> PayloadHandle, validated
    MooncakeSettings     where the Mooncake master is, how to reach it
    LocalCluster         an embedded master + store host (tests, demos)
    errors               the exception tree
    __version__

Nothing here imports Mooncake or torch; they load on first use.
"""

from mooncake_diffusion import errors
from mooncake_diffusion._mooncake.cluster import LocalCluster
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import Publication, ReceivedPayload, StagePayload
from mooncake_diffusion.wire.schema import PayloadHandle, decode_handle

__version__ = "0.1.0"

__all__ = [
    "DiffusionConnector",
    "LocalCluster",
    "MooncakeSettings",
    "PayloadHandle",
    "Publication",
    "ReceivedPayload",
    "StagePayload",
    "__version__",
    "decode_handle",
    "errors",
]

"""Stand-in for ``lightx2v.utils.envs``: the working dtype (``$DTYPE``, BF16 or FP16)."""

import os

import torch

_DTYPES = {"BF16": torch.bfloat16, "FP16": torch.float16}


def GET_DTYPE() -> torch.dtype:
    return _DTYPES[os.getenv("DTYPE", "BF16")]

"""Import first in every process of the vLLM-Omni engine tests (CPU machines only).

vllm 0.30.0 pulls torchvision 0.28.0, torchaudio 2.11.0 and torchcodec from PyPI,
which are CUDA builds: their native extensions need ``libc10_cuda.so``, which the
CPU build of torch lacks, so importing them raises and takes ``import vllm.config``
(through transformers' optional image/audio helpers) down with it. No connector
code uses them. Marking them absent in ``sys.modules`` makes transformers see them
as not installed (``importlib.util.find_spec`` returns ``None``), which is how
vLLM and vLLM-Omni import on a machine without them. On a GPU machine with the
CUDA torch nothing here is needed; it only runs when torch has no CUDA.

On a machine without an NVIDIA device (whatever torch build) it also sets
``HUMMING_DISABLE_PARALLEL_BUILD=1`` (before vllm is imported, so for this process
and the ones it starts): vllm imports ``humming``, a GPU kernel library whose
import starts two background Python processes that build CUDA helpers; without a
GPU they fail after about 2 s of a core each, in every process that imports vllm,
beside the tests. Nothing of the connector uses them. The check looks for the
device nodes, so nothing initialises CUDA before vllm does.
"""

from __future__ import annotations

import glob
import os
import sys

CUDA_ONLY_WHEELS = ("torchvision", "torchaudio", "torchcodec")


def hide_cuda_only_wheels() -> None:
    import torch

    if torch.version.cuda is None or not glob.glob("/dev/nvidia[0-9]*"):
        os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    if torch.version.cuda is None:
        for name in CUDA_ONLY_WHEELS:
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]


hide_cuda_only_wheels()

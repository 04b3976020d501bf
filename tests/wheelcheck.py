"""The Mooncake wheel of an engine environment matches that environment's torch.

Collected by each ``tests/engines/NAME`` (``from wheelcheck import *``), so it
runs in every engine environment. The build checked is the one a deployment of
that environment installs: ``$MCD_MOONCAKE_DEPLOY/mooncake`` where ``./dev``
put the wheel of ``mooncake-diffusion[<extra for this torch>]`` beside the CPU
wheel the CPU tests import (a CUDA build cannot be imported without the NVIDIA
driver), else the installed ``mooncake``. Its libraries are read, not loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from mooncake_diffusion.platform.deployment import inspect_build, torch_cuda, wheel_for

__all__ = ["test_mooncake_wheel_matches_torch"]


def test_mooncake_wheel_matches_torch() -> None:
    deploy = os.environ.get("MCD_MOONCAKE_DEPLOY")
    build = inspect_build(Path(deploy) / "mooncake" if deploy else None)
    assert build is not None, f"no Mooncake build found (MCD_MOONCAKE_DEPLOY={deploy!r})"
    cuda = torch_cuda()
    want = wheel_for(cuda)
    torch_major = int(cuda.split(".")[0]) if cuda else None
    assert build.cuda_major == torch_major == want.cuda_major, (
        f"torch CUDA {cuda}, Mooncake in {build.root} links CUDA {build.cuda_major}: "
        f"{build.libraries}"
    )

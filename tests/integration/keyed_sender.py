"""A KeyedHandoff producer in its own process, for the crash and clean-exit tests.

``{"op": "send", "key": K, "numel": N, "seed": S}`` sends ``{"t": randn(N), "seed": S}``
under K and replies with the size; ``{"op": "shutdown"}`` closes the handoff cleanly.
Settings come from the environment; ``argv[1]`` is ``ttl_s`` (``0``: none).
"""

import sys

import torch

from mooncake_diffusion.handoff.keyed import KeyedHandoff
from mooncake_diffusion.platform.childproc import serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings


def main() -> None:
    ttl = float(sys.argv[1]) or None
    kh = KeyedHandoff(MooncakeSettings.from_env(), ttl_s=ttl, sweep_s=0)

    def send(cmd: dict) -> dict:
        g = torch.Generator().manual_seed(cmd["seed"])
        n = kh.send(cmd["key"], {"t": torch.randn(cmd["numel"], generator=g), "seed": cmd["seed"]})
        return {"ok": True, "size": n}

    def shutdown(cmd: dict) -> dict:
        kh.close()
        return {"ok": True}

    try:
        serve_json_lines({"send": send, "shutdown": shutdown}, sys.stdin, sys.stdout)
    finally:
        kh.close()


if __name__ == "__main__":
    main()

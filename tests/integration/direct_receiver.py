"""A ``DirectEngine`` receiver in its own process, for the bounded-write test.

``{"op": "setup", "nbytes": N}`` registers an N-byte landing buffer and replies
with the engine's segment and the buffer's address; ``{"op": "byte", "at": I}``
replies with the buffer's byte ``I``. Settings come
from the environment. Its own stdout copy carries the protocol (native prints
go to stderr).
"""

import os
import sys

import torch

from mooncake_diffusion.childproc import serve_json_lines
from mooncake_diffusion.direct import DirectEngine
from mooncake_diffusion.settings import MooncakeSettings


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    engine = DirectEngine(MooncakeSettings.from_env())
    state: dict = {}

    def setup(cmd: dict) -> dict:
        buf = torch.zeros(cmd["nbytes"], dtype=torch.uint8)
        engine.register(buf.data_ptr(), buf.numel())
        state["buf"] = buf
        return {"ok": True, "segment": engine.segment, "addr": buf.data_ptr()}

    def byte(cmd: dict) -> dict:
        return {"ok": True, "byte": int(state["buf"][cmd["at"]])}

    serve_json_lines({"setup": setup, "byte": byte}, sys.stdin, proto)
    engine.close()


if __name__ == "__main__":
    main()

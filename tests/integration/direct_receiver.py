"""A ``DirectEngine`` receiver in its own process, for the bounded-write test.

``{"op": "setup", "nbytes": N, "pool": bool}`` registers an N-byte landing
buffer (a shared pool from ``allocate_pool`` with ``pool``) and replies with the
engine's segment, session and the buffer's address; ``{"op": "byte", "at": I}``
replies with the buffer's byte ``I``. Settings come
from the environment. Its own stdout copy carries the protocol (native prints
go to stderr).
"""

import os
import sys

import torch

from mooncake_diffusion.handoff.direct import DirectEngine, allocate_pool
from mooncake_diffusion.platform.childproc import serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    engine = DirectEngine(MooncakeSettings.from_env())
    state: dict = {}

    def setup(cmd: dict) -> dict:
        if cmd.get("pool"):
            buf = allocate_pool(cmd["nbytes"]).tensor
        else:
            buf = torch.zeros(cmd["nbytes"], dtype=torch.uint8)
        engine.register(buf.data_ptr(), buf.numel())
        state["buf"] = buf
        reply = {"segment": engine.segment, "session": engine.session}
        return {"ok": True, **reply, "addr": buf.data_ptr()}

    def byte(cmd: dict) -> dict:
        return {"ok": True, "byte": int(state["buf"][cmd["at"]])}

    serve_json_lines({"setup": setup, "byte": byte}, sys.stdin, proto)
    engine.close()


if __name__ == "__main__":
    main()

"""A store request held across a Mooncake master failover, run on a namespace host.

    python master_client.py GATE

Settings from the environment (``MooncakeSettings.from_env``: an ``etcd://`` master,
``MC_STORE_CLUSTER_ID``). Puts ``in-flight`` (1 MiB, a known pattern), prints
``HELD`` and waits until the file ``GATE`` holds a number: the time (``time.time()``,
one kernel, one clock) at which the scenario killed the master leader. Then, polling
every 50 ms for up to 120 s, puts and reads back ``after`` until that works
(``failover_s``: from the kill to then), and finishes the held request: reads
``in-flight`` back, and where the new leader lost it, puts it again (a rerun, as a
stage whose input is gone is rerun) and reads it back. Removes both keys and prints
one JSON line: ``failover_s``, ``kept`` (the held input survived), ``rerun``,
``completed`` (read back bitwise equal). The caller kills this process after that
line: closing a client of an HA master takes about 30 s (``_mooncake/ha.py``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.settings import MooncakeSettings

MIB = 1 << 20
LIMIT_S = 120.0


def _until(ok, limit_s: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            if ok():
                return
        except MooncakeDiffusionError:
            pass  # the takeover window: RPC errors until the new leader serves
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {limit_s:.0f}s")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    gate = Path(argv[0])
    client = StoreClient(MooncakeSettings.from_env())
    buf = torch.zeros(2 * MIB, dtype=torch.uint8)
    client.regs.pin(describe("b", buf)[1])
    src, dst = buf[:MIB], buf[MIB:]
    src.copy_(torch.arange(MIB, dtype=torch.int64).to(torch.uint8))
    put = [[src.data_ptr()]], [[MIB]]
    get = [[dst.data_ptr()]], [[MIB]]
    client.put_many(["in-flight"], *put, pin="hard")
    print("HELD", flush=True)
    while not gate.exists() or not gate.read_text().strip():
        time.sleep(0.01)
    killed = float(gate.read_text())

    def round_trip(key: str) -> bool:
        client.put_many([key], *put, pin="hard")
        dst.zero_()
        return client.get_many([key], *get) == [True] and bool(torch.equal(src, dst))

    _until(lambda: round_trip("after"))
    failover_s = time.time() - killed
    dst.zero_()
    kept = False
    with contextlib.suppress(MooncakeDiffusionError):
        kept = client.get_many(["in-flight"], *get) == [True] and bool(torch.equal(src, dst))
    rerun = not kept
    completed = kept
    if rerun:
        _until(lambda: round_trip("in-flight"))
        completed = True
    client.remove_many(["in-flight", "after"])
    out = {"failover_s": round(failover_s, 3), "kept": kept, "rerun": rerun}
    print(json.dumps({**out, "completed": completed}), flush=True)
    time.sleep(3600)  # the caller kills this process (module docstring)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

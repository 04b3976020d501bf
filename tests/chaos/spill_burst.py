"""A burst of soft-pinned objects into the Store, run as a process on a namespace host.

    python spill_burst.py --objects N --object-bytes B

Settings from the environment (``MooncakeSettings.from_env``: the master of the
spilling store host). Puts ``N`` objects of ``B`` bytes (object ``i`` filled with
``i % 251``; a put that finds the pool full is retried for up to 60 s, then the burst
stops), reads each stored one back and checks every byte, removes them, and prints one
JSON line: ``objects``, ``put``, ``intact``, ``put_s``, ``get_s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import StoreFullError
from mooncake_diffusion.memory.tensors import describe
from mooncake_diffusion.platform.settings import MooncakeSettings

#: how long one put may keep finding the pool full before the burst stops
PUT_RETRY_S = 60.0


def _put(client: StoreClient, key: str, ptr: int, nbytes: int) -> bool:
    deadline = time.monotonic() + PUT_RETRY_S
    while True:
        try:
            client.put_many([key], [[ptr]], [[nbytes]], pin="soft")
            return True
        except StoreFullError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def burst(client: StoreClient, buf: torch.Tensor, objects: int) -> dict[str, object]:
    nbytes = buf.numel()
    start = time.monotonic()
    stored = []
    for i in range(objects):
        buf.fill_(i % 251)
        if not _put(client, f"spill-burst-{i}", buf.data_ptr(), nbytes):
            break
        stored.append(i)
    put_s = time.monotonic() - start
    intact = 0
    for i in stored:
        buf.zero_()
        ok = client.get_many([f"spill-burst-{i}"], [[buf.data_ptr()]], [[nbytes]]) == [True]
        intact += ok and bool((buf == i % 251).all())
    get_s = time.monotonic() - start - put_s
    client.remove_many([f"spill-burst-{i}" for i in stored])
    return {
        "objects": objects,
        "put": len(stored),
        "intact": intact,
        "put_s": round(put_s, 3),
        "get_s": round(get_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--objects", type=int, required=True)
    ap.add_argument("--object-bytes", type=int, required=True)
    a = ap.parse_args(argv)
    client = StoreClient(MooncakeSettings.from_env())
    buf = torch.zeros(a.object_bytes, dtype=torch.uint8)
    client.regs.pin(describe("b", buf)[1])
    try:
        print(json.dumps(burst(client, buf, a.objects)), flush=True)
    finally:
        client.regs.unpin(describe("b", buf)[1])
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

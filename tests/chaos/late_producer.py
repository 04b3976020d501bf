"""A p2p producer for ``test_late_write``: on its host's address (argv[1]) it
publishes one chunked payload (``SHAPE``, ``SEED``, ``CHUNKS`` chunks along dim 0),
readies chunk 0 at once and prints ``handle HEX``; it readies the other chunks once
the file argv[2] exists (the test cuts its link first), then runs until SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import threading

from mooncake_diffusion.handoff.demo import make_tensor
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector
from mooncake_diffusion.transfer.payload import StagePayload

SHAPE = (4, 1 << 20)  # float32: 16 MiB, four chunks of 4 MiB
SEED = 71
CHUNKS = 4


def main() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settings = MooncakeSettings(local_hostname=sys.argv[1], same_host=False)
    with DiffusionConnector("denoise", "p2p", settings) as conn:
        tensor = make_tensor("float32", SHAPE, SEED)
        payload = StagePayload("a", "latent", tensor=tensor, chunk_dim=0, num_chunks=CHUNKS)
        pub = conn.publish(payload, stream=True)
        pub.chunk_ready(0)
        print(f"handle {pub.encode().hex()}", flush=True)
        while not os.path.exists(sys.argv[2]):
            if stop.wait(0.05):
                return 0
        for i in range(1, CHUNKS):
            pub.chunk_ready(i)
        print("readied", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A p2p side-channel producer for ``test_peer_gone``: serves on its host's address
(argv[1]), prints ``serving HOST:PORT``, and answers a fetch of payload ``hold`` with
``ChunkDone(0)`` and then nothing (it keeps the connection open, as a producer
writing a long chunk does), of payload ``slow`` with ``ChunkDone(0)`` and ``ok``
``SLOW_S`` later, of any other with ``ok`` at once. Runs until SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading

from mooncake_diffusion.transfer.sidechannel import SideChannelServer
from mooncake_diffusion.wire.schema import ChunkDone, FetchReply, FetchRequest

SLOW_S = 3.0


def main() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def handler(req: FetchRequest, progress: object) -> FetchReply:
        if req.payload_id not in ("hold", "slow"):
            return FetchReply("ok")
        progress(ChunkDone(0, "net"))  # type: ignore[operator]
        if stop.wait(SLOW_S if req.payload_id == "slow" else None):
            return FetchReply("failed", "stopped")
        return FetchReply("ok")

    server = SideChannelServer(sys.argv[1], handler)
    print(f"serving {server.endpoint}", flush=True)
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The store host: a process that only holds Mooncake Store's DRAM pool.

Mooncake objects live only as long as the process that mounted their segment,
so the pool lives here, neither producer nor consumer. Run as
``python -m mooncake_diffusion._mooncake.store_host --master H:P --admin H:P
--pool-bytes N``; it prints one JSON line ``{"ready": true, ...}`` on stdout
once mounted, then serves until SIGTERM or SIGINT (or stdin closing, with
``--exit-on-stdin-eof``, so it never outlives its parent). It also runs the
``leases.Reaper`` for its pool, removing payloads whose TTL has passed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from mooncake_diffusion._mooncake.master import probe_master
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.leases import Reaper
from mooncake_diffusion.settings import MooncakeSettings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--master", required=True)
    p.add_argument("--admin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--pool-bytes", type=int, required=True)
    p.add_argument("--exit-on-stdin-eof", action="store_true")
    p.add_argument(
        "--reap-interval",
        type=float,
        default=1.0,
        help="seconds between sweeps for expired payloads (0: no reaper)",
    )
    a = p.parse_args(argv)
    settings = MooncakeSettings(master=a.master, admin=a.admin, local_hostname=a.host)
    probe_master(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    client = StoreClient(settings, segment_bytes=a.pool_bytes)
    reaper = Reaper(settings, a.reap_interval, client).start() if a.reap_interval > 0 else None
    print(json.dumps({"ready": True, "pool_bytes": a.pool_bytes}), flush=True)
    if a.exit_on_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    if reaper is not None:
        reaper.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

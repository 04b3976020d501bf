"""Fill the store pool with hard-pinned records until it refuses one (the "full pool"
scenario's tenant). Prints ``full N`` (records stored), then holds them until SIGTERM,
removes them and exits 0. Settings come from the MOONCAKE_* environment."""

from __future__ import annotations

import signal
import sys
import threading

from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.handoff.mailbox import Mailbox
from mooncake_diffusion.platform.settings import MooncakeSettings

PREFIX = "chaos-fill/"


def main() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    record = b"\xa5" * (4 << 20)
    n = 0
    with Mailbox(MooncakeSettings.from_env(), namespace=PREFIX, max_record=len(record)) as box:
        try:
            while n < 4096:
                box.post(str(n), record)
                n += 1
        except MooncakeDiffusionError as e:
            print(f"full {n} ({type(e).__name__})", flush=True)
        stop.wait()
        box.discard_prefix("")
    print(f"emptied {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

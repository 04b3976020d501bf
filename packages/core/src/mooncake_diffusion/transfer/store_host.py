"""The store host: a process that only holds Mooncake Store's DRAM pool.

Mooncake objects live only as long as the process that mounted their segment,
so the pool lives here, neither producer nor consumer. Run as
``python -m mooncake_diffusion.transfer.store_host --master H:P --admin H:P
--pool-bytes N``; it prints one JSON line ``{"ready": true, ...}`` on stdout
once mounted, then serves until SIGTERM or SIGINT (or stdin closing, with
``--exit-on-stdin-eof``, so it never outlives its parent). It also runs the
``leases.Reaper`` for its pool, removing payloads whose TTL has passed.

``--prefault`` faults the whole pool in before it says ready. Over TCP nothing
else does (RDMA registration pins, and so faults in, every page): the first
pass of puts through a fresh pool pays a page fault per 4 KiB in this process,
which made a 16 MiB put about twice as slow as the same put into pages used
before (``docs/performance.md``). It costs the pool's memory up front, which a
pool that serves traffic uses anyway.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import sys
import threading

from mooncake_diffusion._mooncake.master import probe_master
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.platform import bindshim
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.leases import Reaper

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, contents unchanged


def _anonymous_mappings(min_bytes: int) -> set[tuple[int, int]]:
    """This process's private anonymous read-write mappings of at least ``min_bytes``,
    as ``(start, end)``."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 5 and fields[1].startswith("rw") and fields[1][3] == "p":
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if hi - lo >= min_bytes:
                    found.add((lo, hi))
    return found


def prefault(before: set[tuple[int, int]], min_bytes: int) -> int:
    """Fault in every anonymous mapping of at least ``min_bytes`` that is not in
    ``before`` (the pool Mooncake mapped since); returns the bytes faulted in.
    Raises ``OSError`` where the kernel cannot (before 5.14)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in sorted(_anonymous_mappings(min_bytes) - before):
        if libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "madvise(MADV_POPULATE_WRITE) of the store pool failed")
        done += hi - lo
    return done


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
    p.add_argument(
        "--prefault",
        action="store_true",
        help="fault the whole pool in before saying ready (see the module docstring)",
    )
    p.add_argument(
        "--spill-dir",
        help="spill a full pool to files in this directory (_mooncake/spill.py); "
        "the master needs -enable_offload",
    )
    a = p.parse_args(argv)
    bindshim.check(a.host)  # its Transfer Engine listens on --host only under the shim
    settings = MooncakeSettings(master=a.master, admin=a.admin, local_hostname=a.host)
    probe_master(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # the pool is one mapping of at least its size, or a few large ones
    min_bytes = min(a.pool_bytes, 64 << 20)
    before = _anonymous_mappings(min_bytes) if a.prefault else set()
    client = StoreClient(settings, segment_bytes=a.pool_bytes, spill_dir=a.spill_dir)
    faulted = 0
    if a.prefault:
        try:
            faulted = prefault(before, min_bytes)
        except OSError as e:  # only slower first puts: say so and serve
            print(f"store host: pool not prefaulted: {e}", file=sys.stderr, flush=True)
    reaper = Reaper(settings, a.reap_interval, client).start() if a.reap_interval > 0 else None
    ready = {"ready": True, "pool_bytes": a.pool_bytes, "prefaulted_bytes": faulted}
    print(json.dumps(ready), flush=True)
    if a.exit_on_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    if reaper is not None:
        reaper.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Concurrent takers of one mailbox key, across processes: is each record taken once?

``race(settings, takers, keys)`` starts ``takers`` processes (``python mailbox_race.py``),
each with its own ``Mailbox``; for each of ``keys`` names it posts one record while
every taker is polling ``take`` on it, then counts how many takers got it. Returns
``{"keys": n, "double_takes": keys delivered more than once, "never_taken": ...}``.
The protocol on the takers' stdin/stdout is one JSON line per key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from mooncake_diffusion.handoff.mailbox import Mailbox
from mooncake_diffusion.platform.settings import MooncakeSettings

NAMESPACE = "chaos-race/"


def _taker() -> int:
    box = Mailbox(MooncakeSettings.from_env(), namespace=NAMESPACE, max_record=64)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = json.loads(line)["name"]
        # the record is posted ~2 ms after the name arrives; a taker that lost the race
        # keeps polling until this deadline, so it bounds each key's round
        got = box.take_until(name, time.monotonic() + 1.0)
        print(json.dumps({"name": name, "got": got is not None}), flush=True)
    box.close()
    return 0


def race(settings: MooncakeSettings, takers: int, keys: int) -> dict[str, Any]:
    env = {**os.environ, **settings.as_env()}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(takers)
    ]
    double = never = 0
    box = Mailbox(settings, namespace=NAMESPACE, max_record=64)
    try:
        for p in procs:
            assert json.loads(p.stdout.readline())["ready"]  # type: ignore[union-attr]
        for k in range(keys):
            name = f"k{os.getpid()}-{k}"
            for p in procs:  # every taker polls before the record exists
                p.stdin.write(json.dumps({"name": name}) + "\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            time.sleep(0.002)
            box.post(name, b"record %d" % k)
            got = sum(json.loads(p.stdout.readline())["got"] for p in procs)  # type: ignore[union-attr]
            double += got > 1
            never += got == 0
            box.discard(name)
    finally:
        box.discard_prefix("")
        box.close()
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(30)
    return {"keys": keys, "takers": takers, "double_takes": double, "never_taken": never}


if __name__ == "__main__":
    sys.exit(_taker())

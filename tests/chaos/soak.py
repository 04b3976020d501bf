"""Soak through the service: many requests through a real orchestrator and toy worker
processes over real Mooncake Store, with random cancels and worker SIGKILLs (each
victim restarted). Afterwards every request is accounted for and every resource is
back at its baseline: store keys, the orchestrator's fds and threads, processes.

``soak(cluster, tmp, n, ...)`` returns the account; the test tier runs it small,
``bench/chaos.py`` with 1,000 requests.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from servicestack import ServiceStack

from mooncake_diffusion.orchestrator.errors import OrchestratorError
from mooncake_diffusion.orchestrator.worker import toy

TERMINAL = ("completed", "failed", "cancelled")
WORKERS = (
    ("encode", "enc-0"),
    ("denoise", "den-0"),
    ("denoise", "den-1"),
    ("decode", "dec-0"),
    ("decode", "dec-1"),
)


def _counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def _children() -> set[int]:
    """Live child processes of this process (zombies included: they are leaks too)."""
    me = str(os.getpid())
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        out.add(int(pid))
            except (OSError, IndexError):
                continue
    return out


def soak(
    cluster: Any, tmp: Path, n: int, *, seed: int = 0, cancel_p: float = 0.1, kills: int = 3
) -> dict[str, Any]:
    rng = random.Random(seed)
    keys0 = set(cluster.keys())
    children0 = _children()
    s = ServiceStack(tmp, cluster.settings.as_env(), heartbeat_timeout=5.0)
    account: Counter[str] = Counter()
    try:
        s.start_orchestrator()
        for stage, wid in WORKERS:
            s.start_worker(stage, wid, credits=2)
        c = s.client
        assert c is not None
        warm = [c.submit({"prompt": f"warm{i}", "steps": 2, "size": 256}) for i in range(4)]
        for rid in warm:
            st = c.wait(rid, timeout=120)
            assert st["state"] == "completed", st
        time.sleep(0.5)
        base = _counts(s.orchestrator.pid)  # type: ignore[union-attr]
        kill_at = set(rng.sample(range(n // 10, n), min(kills, max(0, n - n // 10))))
        params: dict[str, dict] = {}
        inflight: list[str] = []
        for i in range(n):
            p = {"prompt": f"soak {seed} {i}", "steps": rng.choice((1, 2, 4)), "size": 256}
            cancel = rng.random() < cancel_p
            if cancel:  # slow enough that the cancel lands while it runs (no race)
                p.update(steps=4, step_s=0.5)
            rid = c.submit(p, request_id=f"soak{seed}-{i}")
            params[rid] = p
            inflight.append(rid)
            if cancel:
                with contextlib.suppress(OrchestratorError):  # it may have finished first
                    c.cancel(rid)
            if i in kill_at:
                stage, wid = rng.choice(WORKERS[1:])
                s.workers[wid].kill()
                account["worker_kills"] += 1
                s.start_worker(stage, wid, credits=2)
            while len(inflight) > 16:  # a steady load, not a burst
                if c.status(inflight[0])["state"] in TERMINAL:
                    inflight.pop(0)
                else:
                    time.sleep(0.01)
        for rid, p in params.items():
            st = c.wait(rid, timeout=120)
            account["accepted"] += 1
            if st["state"] not in TERMINAL:
                account["lost"] += 1
                continue
            account[st["state"]] += 1
            kinds = Counter((e["kind"], e.get("stage")) for e in st["events"])
            account["duplicates"] += sum(
                k - 1 for (kind, _), k in kinds.items() if kind in ("done", "completed") and k > 1
            )
            if st["state"] == "completed":
                out = json.loads(base64.b64decode(st["output"]))
                if abs(out["checksum"] - toy.expected_checksum(p)) > 1e-3 * max(
                    1, abs(out["checksum"])
                ):
                    account["wrong_outputs"] += 1
            elif st["state"] == "failed" and not st.get("reasons"):
                account["failed_without_reason"] += 1
        # the store: every payload of a finished request is released shortly after
        deadline = time.monotonic() + 20
        while set(cluster.keys()) - keys0 and time.monotonic() < deadline:
            time.sleep(0.2)
        account["leaked_keys"] = len(set(cluster.keys()) - keys0)
        deadline = time.monotonic() + 10
        while True:
            now = _counts(s.orchestrator.pid)  # type: ignore[union-attr]
            if (now[0] <= base[0] and now[1] <= base[1]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        account["leaked_fds"] = max(0, now[0] - base[0])
        account["leaked_threads"] = max(0, now[1] - base[1])
    finally:
        rcs = s.close()
    account["unclean_exits"] = sum(1 for rc in rcs.values() if rc != 0)
    account["leaked_processes"] = len(_children() - children0)
    return dict(account)

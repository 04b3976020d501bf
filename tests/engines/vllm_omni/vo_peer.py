"""The other process of the vLLM-Omni engine tests: a stage process with one connector.

Run as ``python tests/engines/vllm_omni/vo_peer.py``; driven by JSON lines
(``mooncake_diffusion.platform.childproc``). It loads vLLM's general plugins (which runs
this adapter's entry point), builds the connector through vLLM-Omni's own
factory, and then puts or gets the payloads of ``vo_payloads`` on request,
answering with digests so the test process can compare every byte.

    {"op": "make", "name": ..., "extra": {...}}  -> {"registered": [...]}
    {"op": "put", "kind": ..., "seed": ..., "key": ..., "from": "0", "to": "1", ...}
    {"op": "get", "key": ..., "from": ..., "to": ..., "deadline_s": null | float}
    {"op": "hold_get", "key": ..., "from": ..., "to": ...}  -> once the get is held
    {"op": "cleanup", "request_id": ...} / {"op": "health"} / {"op": "close"}

``hold_get`` starts a get that stops for good right after it claimed the record,
before any byte was read, and answers once it is there (the test then kills this
process: a stage that crashes while reading its input).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

# vLLM logs to stdout: keep the real stdout for the protocol, send fd 1 to stderr
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vo_cpu_env  # noqa: E402, F401  (before anything imports vllm)
import vo_payloads  # noqa: E402

from mooncake_diffusion.platform.childproc import serve_json_lines  # noqa: E402

_state: dict[str, Any] = {}


def make(cmd: dict) -> dict:
    from vllm.plugins import load_general_plugins
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    load_general_plugins()
    old = _state.pop("conn", None)
    if old is not None:
        old.close()
    _state["conn"] = OmniConnectorFactory.create_connector(
        ConnectorSpec(name=cmd["name"], extra=cmd["extra"])
    )
    return {"ok": True, "registered": OmniConnectorFactory.list_registered_connectors()}


def put(cmd: dict) -> dict:
    kw = {k: cmd[k] for k in ("chunk_id", "last", "mb") if k in cmd}
    data = vo_payloads.build(cmd["kind"], cmd["seed"], **kw)
    t0 = time.perf_counter()
    ok, size, meta = _state["conn"].put(cmd["from"], cmd["to"], cmd["key"], data)
    seconds = time.perf_counter() - t0
    return {
        "ok": True,
        "success": ok,
        "size": size,
        "has_meta": meta is not None,
        "digest": vo_payloads.expected_digest(data),
        "seconds": seconds,
    }


def get(cmd: dict) -> dict:
    conn = _state["conn"]
    t0 = time.perf_counter()
    if cmd.get("deadline_s") is None:
        got = conn.get(cmd["from"], cmd["to"], cmd["key"])
    else:
        deadline = time.monotonic() + cmd["deadline_s"]
        got = conn.get_with_deadline(cmd["from"], cmd["to"], cmd["key"], deadline=deadline)
        conn.abandon_get(cmd["key"])
    seconds = time.perf_counter() - t0
    if got is None:
        return {"ok": True, "found": False, "seconds": seconds}
    obj, size = got
    return {
        "ok": True,
        "found": True,
        "size": size,
        "type": type(obj).__name__,
        "digest": vo_payloads.digest(obj),
        "seconds": seconds,
    }


def hold_get(cmd: dict) -> dict:
    import threading

    from mooncake_diffusion.handoff import keyed

    reached, forever = threading.Event(), threading.Event()
    before = keyed._destinations

    def destinations(*args: Any) -> Any:
        reached.set()
        forever.wait()
        return before(*args)

    keyed._destinations = destinations
    conn = _state["conn"]
    threading.Thread(
        target=conn.get, args=(cmd["from"], cmd["to"], cmd["key"]), daemon=True
    ).start()
    if not reached.wait(120):
        raise RuntimeError("the get never claimed the record")
    return {"ok": True}


def cleanup(cmd: dict) -> dict:
    _state["conn"].cleanup(cmd["request_id"])
    return {"ok": True}


def health(cmd: dict) -> dict:
    return {"ok": True, "health": _state["conn"].health()}


def reap(cmd: dict) -> dict:
    _state["conn"].reap_consumed()
    return {"ok": True}


def close(cmd: dict) -> dict:
    conn = _state.pop("conn", None)
    if conn is not None:
        conn.close()
    return {"ok": True}


def ready(cmd: dict) -> dict:
    import vllm_omni.distributed.omni_connectors.factory  # noqa: F401  (the slow import)

    return {"ok": True}


if __name__ == "__main__":
    try:
        serve_json_lines(
            {
                "ready": ready,
                "make": make,
                "put": put,
                "get": get,
                "hold_get": hold_get,
                "health": health,
                "reap": reap,
                "cleanup": cleanup,
                "close": close,
            },
            sys.stdin,
            _PROTOCOL,
        )
    finally:
        close({})

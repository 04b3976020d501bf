"""A keyed-handoff party in its own process, stopped at an exact store operation.

``{"op": "start", "call": C, ...}`` runs one call on a thread (``send`` of a
tensor, ``receive``, or a mailbox ``claim`` / ``confirm``) with a gate on the
mailbox's store client, and answers once the call reached the gate or ended:

- ``hold_after_lease_read``: stop right after the first read of a lease key (a
  claimer that has just seen another's lease);
- ``hold_before_write: n``: stop before the ``n``-th write (put or remove) the
  call sends to the store;
- ``hold_after_write: n``: stop right after the ``n``-th write returned.

``{"op": "release"}`` opens the gate and answers the call's result once it
ended. The gates wrap the store client's methods of both the protocol before
the delivery rule and after it, so one test holds either at the same point.
Settings come from the environment.
"""

import sys
import threading

import torch

from mooncake_diffusion.handoff.keyed import KeyedHandoff
from mooncake_diffusion.platform.childproc import serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings

_WRITES = ("put_each", "remove_each", "put_many", "claim", "remove_many")


def main() -> None:
    kh = KeyedHandoff(
        MooncakeSettings.from_env(), lease_s=float(sys.argv[1]), sweep_s=0, timeout_s=20
    )
    client = kh._client
    state: dict = {"claim": None}
    reached, opened, ended = threading.Event(), threading.Event(), threading.Event()
    gate = {"writes": 0, "lease_reads": 0, "spec": {}}

    def wait_here() -> None:
        reached.set()
        opened.wait()

    def wrap_write(name: str) -> None:
        real = getattr(client, name)

        def write(*args, **kw):
            gate["writes"] += 1
            n, spec = gate["writes"], gate["spec"]
            if spec.get("hold_before_write") == n:
                wait_here()
            try:
                return real(*args, **kw)
            finally:
                if spec.get("hold_after_write") == n:
                    wait_here()

        setattr(client, name, write)

    for name in _WRITES:
        if hasattr(client, name):
            wrap_write(name)
    real_read = client.read

    def read(key, *args, **kw):
        got = real_read(key, *args, **kw)
        if "-lease/" in key and gate["spec"].get("hold_after_lease_read"):
            gate["lease_reads"] += 1
            if gate["lease_reads"] == 1:
                wait_here()
        return got

    client.read = read

    def run(cmd: dict) -> None:
        try:
            if cmd["call"] == "send":
                n = kh.send(cmd["key"], {"t": torch.full((cmd["numel"],), float(cmd["value"]))})
                state["result"] = {"sent": n}
            elif cmd["call"] == "receive":
                got = kh.receive(cmd["key"])
                state["result"] = {"got": None if got is None else float(got[0]["t"][0])}
            elif cmd["call"] == "claim":
                claim = kh._mailbox.claim(cmd["key"], kh.lease_s)
                state["claim"] = claim
                state["result"] = {"claimed": claim is not None}
            elif cmd["call"] == "confirm":
                state["result"] = {"confirmed": state["claim"].confirm()}
        except Exception as e:  # the parent asserts on it
            state["result"] = {"error": type(e).__name__, "message": str(e)}
        finally:
            ended.set()
            reached.set()

    def start(cmd: dict) -> dict:
        for event in (reached, opened, ended):
            event.clear()
        gate.update(writes=0, lease_reads=0, spec=cmd)
        state.pop("result", None)
        threading.Thread(target=run, args=(cmd,), daemon=True).start()
        if not reached.wait(120):
            raise RuntimeError("the call neither reached its gate nor ended")
        if ended.is_set():
            return {"ok": True, "state": "ended", **state["result"]}
        return {"ok": True, "state": "held"}

    def release(cmd: dict) -> dict:
        opened.set()
        if not ended.wait(120):
            raise RuntimeError("the call did not end once released")
        return {"ok": True, "state": "ended", **state["result"]}

    serve_json_lines({"start": start, "release": release}, sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()

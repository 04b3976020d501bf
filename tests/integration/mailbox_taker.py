"""A mailbox taker in its own process, for the exactly-once test.

``{"op": "go", "name": N}`` starts a thread that calls ``Mailbox.take(N)`` until
it gets the record or is stopped; ``{"op": "stop"}`` stops it and replies with
what it took (hex, or null). Settings come from the environment.
"""

import sys
import threading

from mooncake_diffusion.handoff.mailbox import Mailbox
from mooncake_diffusion.platform.childproc import serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings


def main() -> None:
    box = Mailbox(MooncakeSettings.from_env(), max_record=4096)
    state: dict = {}

    def poll(name: str, stop: threading.Event) -> None:
        while not stop.is_set():
            record = box.take(name)
            if record is not None:
                state["got"] = record
                return

    def go(cmd: dict) -> dict:
        stop = threading.Event()
        thread = threading.Thread(target=poll, args=(cmd["name"], stop), name="taker")
        state.clear()
        state.update(stop=stop, thread=thread)
        thread.start()
        return {"ok": True}

    def stop(cmd: dict) -> dict:
        state["stop"].set()
        state["thread"].join()
        got = state.get("got")
        return {"ok": True, "got": None if got is None else got.hex()}

    try:
        serve_json_lines({"go": go, "stop": stop}, sys.stdin, sys.stdout)
    finally:
        box.close()


if __name__ == "__main__":
    main()

"""A KeyedHandoff consumer in its own process, held at a gate in the middle of a receive.

``{"op": "hold", "key": K, "at": A}`` starts ``receive(K)`` on a thread that stops for
good at gate ``A`` and replies once it is there; the test then SIGKILLs the process.
``A`` is ``claimed`` (the record claimed, no byte read yet) or ``landed`` (every byte
read into this process, the claim not yet confirmed). Settings come from the
environment; ``argv[1]`` is the handoff's ``lease_s``.
"""

import sys
import threading

from mooncake_diffusion.handoff import keyed
from mooncake_diffusion.handoff.keyed import KeyedHandoff
from mooncake_diffusion.platform.childproc import serve_json_lines
from mooncake_diffusion.platform.settings import MooncakeSettings


def main() -> None:
    kh = KeyedHandoff(MooncakeSettings.from_env(), lease_s=float(sys.argv[1]), sweep_s=0)
    reached = threading.Event()
    forever = threading.Event()

    def gate(*_args: object) -> None:
        reached.set()
        forever.wait()

    def hold(cmd: dict) -> dict:
        if cmd["at"] == "claimed":
            before = keyed._destinations

            def destinations(*args: object) -> object:
                gate()
                return before(*args)

            keyed._destinations = destinations
        else:
            kh._commit = gate
        threading.Thread(target=kh.receive, args=(cmd["key"],), daemon=True).start()
        if not reached.wait(120):
            raise RuntimeError(f"the receive never reached the gate {cmd['at']!r}")
        return {"ok": True}

    serve_json_lines({"hold": hold}, sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()

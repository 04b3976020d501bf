"""Small test helpers; the deterministic tensors come from the package's demo so
producer processes and tests agree on every byte."""

from __future__ import annotations

import contextlib

import torch

from mooncake_diffusion.handoff.demo import make_tensor

__all__ = ["driven", "from_service", "make_tensor", "same_bytes"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every byte (NaN payloads included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


class Recorder:
    """Stands in for an engine's register/unregister and enforces its no-overlap rule."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls = 0

    def register(self, ptr: int, n: int, device: str) -> None:
        for p, m in self.live.items():
            assert not (ptr < p + m and p < ptr + n), "engine would reject an overlap (-7)"
        self.live[ptr] = n
        self.calls += 1

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def from_service(sock, kind: type, within: float = 30.0) -> object | None:
    """The next message of ``kind`` an orchestrator service sends ``sock`` (a worker's
    ZeroMQ DEALER), skipping others; None if none came within ``within`` seconds."""
    import time

    from mooncake_diffusion.orchestrator.link.wire import decode_from_service

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode_from_service(sock.recv())
            if isinstance(msg, kind):
                return msg
    return None


@contextlib.contextmanager
def driven(svc, mode: str):  # type: ignore[no-untyped-def]
    """``svc`` (an ``OrchestratorService`` never started) running with its driver as a
    thread of its own (``mode`` ``thread``: ``start``) or turning on an asyncio loop
    in a thread of its own (``loop``: ``run_on_loop``, as under
    ``ApiServer(drive=True)``); yields that loop (None for ``thread``) and closes the
    service after."""
    if mode == "thread":
        svc.start()
        try:
            yield None
        finally:
            svc.close()
        return
    import asyncio
    import threading

    ready: list = []
    opened, stop = threading.Event(), threading.Event()

    async def main() -> None:
        try:
            svc.run_on_loop()
        except BaseException as e:
            ready.append(e)
            opened.set()
            return
        ready.append(asyncio.get_running_loop())
        opened.set()
        try:
            while not stop.is_set():
                await asyncio.sleep(0.01)
        finally:
            svc.leave_loop()

    t = threading.Thread(target=lambda: asyncio.run(main()), name="test-driver-loop")
    t.start()
    opened.wait(30)
    if isinstance(ready[0], BaseException):
        t.join()
        raise ready[0]
    try:
        yield ready[0]
    finally:
        svc.close()
        stop.set()
        t.join(30)

"""A thread-safe inbox that a ZeroMQ poll loop can wait on.

    inbox = Inbox()
    poller.register(inbox.fileno(), zmq.POLLIN)   # the loop's thread
    inbox.put(item)                               # any thread; wakes the poll
    for item in inbox.drain(): ...                # the loop's thread, after poll returns
    inbox.waiting()                               # any time: is an item queued (no syscall)
    inbox.close()                                 # once, after the loop has ended

Items are delivered in order, each once. ``wake()`` makes the poll return with
nothing queued (to see a flag). ``put``/``wake`` after ``close`` are ignored.
"""

from __future__ import annotations

import contextlib
import os
import queue
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)

    def fileno(self) -> int:
        return self._r

    def put(self, item: T) -> None:
        self._q.put(item)
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._w, b"x")

    def waiting(self) -> bool:
        """Whether an item is queued now (a ``drain`` would yield one); reads no
        file descriptor, so a loop can ask between two pieces of other work."""
        return not self._q.empty()

    def drain(self) -> Iterator[T]:
        """Clear the wake-up and yield what is queued now."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._r, 4096)
        while True:
            try:
                yield self._q.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._r = self._w = -1

"""Mooncake calls that stop every other thread of the process, and who hears first.

Mooncake's Python bindings keep the GIL while a native client or Transfer Engine is
torn down, about a second each (measured on 2026-12-03: ``store.close()`` 0.95 s,
an engine's destruction 0.96 s, no other thread ran meanwhile). A process whose
liveness others judge by a Python thread's timing (a stage worker's heartbeat, with
a timeout of a few seconds) would look dead through two of them in a row. Such a
thread registers a listener; every such call here is made inside ``holding()``,
which calls each listener first, from the thread about to hold the GIL::

    gil.listen(beat_now)        # beat_now() -> None, returns once it acted (bounded)
    with gil.holding("store client close"):
        native.close()
    gil.unlisten(beat_now)

Obligations of a listener: return within a fraction of a second whatever happens
(it delays the call), never raise (an exception is logged and ignored), and cope
with being called from any thread, its own included.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

__all__ = ["holding", "listen", "unlisten"]

log = logging.getLogger("mooncake_diffusion.mooncake")

_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []


def listen(fn: Callable[[], None]) -> None:
    """Call ``fn()`` before each call that holds the GIL for long (module doc)."""
    with _lock:
        _listeners.append(fn)


def unlisten(fn: Callable[[], None]) -> None:
    """Stop calling ``fn`` (no error if it was not listening)."""
    with _lock, contextlib.suppress(ValueError):
        _listeners.remove(fn)


@contextlib.contextmanager
def holding(what: str) -> Iterator[None]:
    """Around one native call that keeps the GIL (``what`` names it in a log line):
    every listener is called first, in the order they registered."""
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn()
        except Exception as e:  # a listener's failure must not stop the teardown
            log.warning("listener %r failed before %s: %s", fn, what, e)
    yield

"""Noticing when the orchestrator's driver could not run, so that the core does
not blame its workers for it (``clock.StallClock`` takes the stall out of time).

    watch = StallWatch().start()        # a thread of its own: notes freezes
    clock.attach(watch)                 # every reading of time takes them out first
    ...                                 # the driver: clock.stalled(turn_s) after a long turn
    clock.detach(); watch.close()

Either kind of stall leaves worker frames queued that were sent while the driver
could not read them:

- the process did not run, or not this interpreter: the time since anything of
  it last ran is far longer than a period (the process stopped, the machine
  paused, a collector pass or anything else holding the interpreter lock). The
  watch's thread wakes every ``PERIOD_S`` and marks the time, and so does every
  ``frozen()`` call, which is how the clock reads it: the first reading of time
  after a freeze, on whichever thread and at whatever point of a turn, counts
  the freeze before it answers. (Asked only before each turn, a process stopped
  in the middle of one would judge that turn's queued frames at the time
  including the stop.)
- a turn of the driver itself ran long (a commit that blocked on the disk, a
  burst of work on a starved machine): the driver measures it, less any freeze
  inside it, and reports it to the clock when the turn ends.

Either counts only past ``STALL_S``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["PERIOD_S", "STALL_S", "StallWatch"]

#: how often the watch wakes
PERIOD_S = 0.1
#: the shortest lateness or turn counted as a stall: far above a collector pass
#: (milliseconds) and a scheduler slice, far below a heartbeat timeout (seconds)
STALL_S = 0.25


class StallWatch:
    """See the module docstring. ``start`` once, ``close`` once (joins the thread);
    ``frozen`` from any thread. ``clock``: where the watch reads the time
    (``time.monotonic``; tests pass one that jumps)."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        stall_s: float = STALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._period, self._stall, self._clock = period_s, stall_s, clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._frozen = 0.0
        #: the last time something of this process was seen running
        self._mark = clock()
        self._thread = threading.Thread(target=self._run, name="mcd-stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def _look(self) -> None:
        """Under the lock: count the time since the last mark as a freeze if it is
        one; mark now."""
        now = self._clock()
        late = now - self._mark - self._period
        if late > self._stall:
            self._frozen += late
        self._mark = max(self._mark, now)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                self._look()

    def frozen(self) -> float:
        """Seconds, in all since the watch was made, that nothing of the process
        ran (never decreases); looks first, so a freeze that just ended counts."""
        with self._lock:
            self._look()
            return self._frozen

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

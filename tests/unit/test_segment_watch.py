"""The segment watch's rules (``_mooncake/segment_watch.py``): recycle the watched
clients when a listed store segment disappears, only once the master lists one
again, retry a recycle that failed, and leave no thread once the last client goes.
The master's listing is scripted here; the real one is in
``tests/integration/test_store_recycle.py``."""

from __future__ import annotations

import threading

import pytest

from mooncake_diffusion._mooncake import segment_watch
from mooncake_diffusion._mooncake.segment_watch import _Watch

pytestmark = pytest.mark.unit


class Client:
    """A recyclable that answers from a script (``True``: recycled)."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.reasons: list[str] = []

    def recycle(self, reason: str) -> bool:
        self.reasons.append(reason)
        return self.answers.pop(0)


def _scripted(w: _Watch, listings: list[set[str] | None]) -> None:
    it = iter(listings)
    w._segments = lambda: next(it)  # type: ignore[method-assign]


def test_recycles_once_a_segment_is_gone_and_another_is_listed():
    w = _Watch("127.0.0.1:1", 10.0)
    c = Client([False, True])
    w.clients[id(c)] = c
    _scripted(w, [{"a"}, {"a", "b"}, None, set(), {"c"}, {"c"}, {"c"}])
    w.tick()  # {"a"}: first listing, nothing to compare
    w.tick()  # {"a", "b"}: a host joined: nothing to do
    w.tick()  # the master does not answer: skipped
    assert c.reasons == []
    w.tick()  # both gone, none listed: pending until one is
    assert c.reasons == [] and id(c) in w.pending
    w.tick()  # {"c"}: recycled, but it failed (False): still pending
    assert len(c.reasons) == 1 and "['a', 'b']" in c.reasons[0]
    assert id(c) in w.pending
    w.tick()  # tried again: done
    assert len(c.reasons) == 2 and not w.pending
    w.tick()  # nothing changed: no recycle
    assert len(c.reasons) == 2


def test_the_watch_thread_lives_while_a_client_is_watched():
    before = set(threading.enumerate())
    a, b = Client([]), Client([])
    segment_watch.watch(a, "127.0.0.1:1", 0.01)  # nothing listens: every tick skipped
    segment_watch.watch(b, "127.0.0.1:1", 0.01)
    started = [t for t in threading.enumerate() if t not in before]
    assert [t.name for t in started] == ["mcd-store-watch"]
    segment_watch.unwatch(a)
    assert started[0].is_alive()
    segment_watch.unwatch(b)
    segment_watch.unwatch(b)  # idempotent
    assert not started[0].is_alive()
    assert a.reasons == b.reasons == []

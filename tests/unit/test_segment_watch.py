"""The segment watch's rules (``_mooncake/segment_watch.py``): recycle the watched
clients when a listed store segment disappears or is mounted again under its own
name, only once the master lists one again, retry a recycle that failed, list the
master before ``watch`` returns, and leave no thread once the last client goes.
The master's listing is scripted here; the real one is in
``tests/integration/test_store_recycle.py``."""

from __future__ import annotations

import threading
from collections import Counter

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


def _scripted(w: _Watch, listings: list) -> None:
    """Each tick's answer: None (no answer), names, or (names, mount count)."""

    def answer(x):
        if x is None:
            return None
        names, mounts = x if isinstance(x, tuple) else (x, None)
        return Counter(names), mounts

    it = iter(listings)
    w._listing = lambda: answer(next(it))  # type: ignore[method-assign]


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


def test_a_store_host_back_on_its_own_address_is_recycled_for():
    """A restarted store host that draws the same address (or has it pinned) keeps
    the segment's name: the list shows it twice until the dead one expires, or, if
    that fell between two ticks, only the mount count tells."""
    w = _Watch("127.0.0.1:1", 10.0)
    c = Client([True, True, True])
    w.clients[id(c)] = c
    _scripted(
        w,
        [
            (["a"], 1),
            (["a", "b"], 2),  # a new host, a new name: nothing to do
            (["a", "b"], 2),
            (["a", "a", "b"], 3),  # "a" restarted: listed twice, one mount: nothing yet
            (["a", "b"], 3),  # the dead "a" expired: one "a" fewer
            (["a", "b"], 4),  # "a" again, both listings between two ticks: the count
            (["a", "b", "c"], 4),  # a mount between the count and the list: "c" first
            (["a", "b", "c"], 5),  # then its count: explained, nothing to do
            (["a", "b", "c"], 1),  # the count went back: the master restarted
        ],
    )
    for _ in range(4):
        w.tick()
    assert c.reasons == []
    w.tick()
    assert len(c.reasons) == 1 and "['a']" in c.reasons[0]
    w.tick()
    assert len(c.reasons) == 2 and "name already listed" in c.reasons[1]
    w.tick()
    w.tick()
    assert len(c.reasons) == 2
    w.tick()
    assert len(c.reasons) == 3 and "master restarted" in c.reasons[2]


def test_the_mount_count_is_read_from_the_metrics_text():
    text = (
        b"# TYPE master_mount_segment_requests_total counter\n"
        b"master_mount_segment_failures_total 0\n"
        b"master_mount_segment_requests_total 12\n"
        b"master_remount_segment_requests_total 3\n"
    )
    m = segment_watch._MOUNTS.search(text)
    assert m is not None and int(float(m.group(1))) == 12
    assert segment_watch._MOUNTS.search(b"master_remount_segment_requests_total 3\n") is None


def test_watch_returns_with_the_masters_listing_as_its_baseline(monkeypatch):
    """A master restarted right after the first client was made, before the watch's
    first interval ran out, is still seen: ``watch`` returns once it listed once."""
    listings = iter([(Counter({"a": 1}), 1), (Counter({"b": 1}), 1)])
    monkeypatch.setattr(_Watch, "_listing", lambda self: next(listings))
    c = Client([True])
    segment_watch.watch(c, "127.0.0.1:1", 60.0)  # its next tick is a minute away
    try:
        w = segment_watch._watches["127.0.0.1:1"]
        assert w.known == Counter({"a": 1})  # listed before watch() returned
        w.tick()  # restarted: only the new host's segment, the mount count back at 1
        assert len(c.reasons) == 1 and "['a']" in c.reasons[0], c.reasons
    finally:
        segment_watch.unwatch(c)
    assert "127.0.0.1:1" not in segment_watch._watches


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

"""The worker tells a lost input (re-run upstream) from any other stage failure."""

from __future__ import annotations

import pytest

from mooncake_diffusion.errors import PayloadGoneError, PeerGoneError, TransientStoreError
from mooncake_diffusion.orchestrator.worker.lost_input import InputWatch


class _Got:
    """A received payload whose chunks raise ``fail`` after the first."""

    def __init__(self, fail: Exception | None) -> None:
        self.fail = fail
        self.path = "store"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def __iter__(self):
        yield "chunk0"
        if self.fail is not None:
            raise self.fail


class _Connector:
    """Raises ``at_consume`` from ``consume``, else returns a ``_Got``."""

    def __init__(self, at_consume=None, in_chunks=None) -> None:
        self.at_consume, self.in_chunks = at_consume, in_chunks
        self.settings = "S"

    def consume(self, handle, timeout=1.0, committed=False):
        self.committed = committed
        if self.at_consume is not None:
            raise self.at_consume
        return _Got(self.in_chunks)


@pytest.mark.parametrize("err", [PayloadGoneError("gone"), PeerGoneError("host died")])
def test_consuming_the_input_that_is_gone_marks_it_lost(err):
    w = InputWatch(_Connector(at_consume=err), b"input-handle")
    with pytest.raises(type(err)):
        w.consume(b"input-handle")
    assert w.lost


def test_a_chunk_that_is_gone_mid_stream_marks_it_lost():
    w = InputWatch(_Connector(in_chunks=PeerGoneError("producer cut off")), b"lat")
    with pytest.raises(PeerGoneError), w.consume(b"lat") as got:
        assert got.path == "store"  # other attributes pass through
        list(got)
    assert w.lost


def test_other_failures_and_other_payloads_do_not():
    w = InputWatch(_Connector(at_consume=TransientStoreError("lease")), b"in")
    with pytest.raises(TransientStoreError):
        w.consume(b"in")  # late, not gone: an ordinary retry
    assert not w.lost
    w = InputWatch(_Connector(at_consume=PayloadGoneError("cache miss")), b"in")
    with pytest.raises(PayloadGoneError):
        w.consume(b"a-cache-entry")  # not the item's input
    assert not w.lost and w.settings == "S"
    w = InputWatch(_Connector(), b"in")
    with w.consume(b"in") as got:
        assert list(got) == ["chunk0"]
    assert not w.lost


def test_the_input_is_consumed_as_committed_other_payloads_are_not():
    c = _Connector()
    w = InputWatch(c, b"in")
    w.consume(b"in")
    assert c.committed is True  # acknowledged upstream: absent means gone, no waiting
    w.consume(b"other")
    assert c.committed is False

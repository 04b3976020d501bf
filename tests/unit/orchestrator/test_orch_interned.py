"""``Interned``: one value per key for all its holders, gone with the last one."""

from __future__ import annotations

import gc
import weakref

import pytest

from mooncake_diffusion.orchestrator.core.interned import Interned

pytestmark = pytest.mark.unit


class _Value(dict):
    """A dict that a weak reference can follow (a plain dict cannot)."""


def test_holders_share_the_first_value_and_the_last_drop_forgets_it():
    table: Interned[str, _Value] = Interned()
    first, second = _Value(a="1"), _Value(a="1")
    assert table.hold("k", first) is first
    assert table.hold("k", second) is first  # the second holder gets the first's value
    assert table.holders("k") == 2 and table.values() == [first]
    gone = weakref.ref(first)
    del first, second
    table.drop("k")
    assert table.holders("k") == 1 and gone() is not None  # one holder left keeps it
    table.drop("k")
    gc.collect()
    assert table.holders("k") == 0 and len(table) == 0 and gone() is None
    assert table.hold("k", _Value(b="2")) == {"b": "2"}  # a key held again starts afresh
    table.drop("k")
    assert len(table) == 0  # leak check: nothing kept


def test_dropping_a_key_nobody_holds_raises_and_changes_nothing():
    table: Interned[str, int] = Interned()
    table.hold("a", 1)
    with pytest.raises(KeyError):
        table.drop("b")
    assert table.values() == [1] and table.holders("a") == 1
    table.drop("a")
    assert len(table) == 0

"""The three windows of the keyed handoff's old protocol, each held open on real
processes at the exact store operation where it was (no race): a real master
and store host, every party a ``KeyedHandoff`` in a process of its own
(``keyed_gated.py``), stopped by a gate on its store client.

Each test fails on the protocol before the delivery rule (``handoff_v1``
transcribes it; ``test_handoff_protocol`` explores it) and passes on
``handoff.protocol``: the gates are placed by store operation (a read of a
lease key, the n-th write), which both protocols make at the point named.
"""

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mooncake_diffusion.handoff.keyed import KeyedHandoff
from mooncake_diffusion.platform.childproc import JsonLinesChild
from mooncake_diffusion.testing import assert_no_leaks

pytestmark = pytest.mark.integration

NUMEL = 256 << 10  # 1 MiB of float32: past inline, so a payload and a leased claim


@pytest.fixture
def parties(mooncake_cluster):
    """``make(lease_s)`` starts a gated party process; all are closed (or killed)
    after the test, then the store and this process are checked for leaks."""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    made: list[JsonLinesChild] = []
    here = KeyedHandoff(mooncake_cluster.settings, sweep_s=0)

    def make(lease_s: float) -> JsonLinesChild:
        argv = [sys.executable, str(Path(__file__).with_name("keyed_gated.py")), str(lease_s)]
        child = JsonLinesChild(argv, mooncake_cluster.settings, f"party {len(made)}")
        made.append(child)
        return child

    yield here, make
    for child in made:
        child.close()
    here.close()
    assert mooncake_cluster.keys() == []
    assert_no_leaks(mooncake_cluster, baseline)


def _send(kh: KeyedHandoff, key: str, value: float) -> None:
    kh.send(key, {"t": torch.full((NUMEL,), value)})


def _lapse(lease_s: float) -> None:
    """Wait until a lease of ``lease_s`` taken before this call has lapsed (a wait
    for a condition of the clock, which nothing else can change)."""
    time.sleep(lease_s + 0.2)


def test_a_claimer_that_saw_a_lapsed_lease_cannot_end_the_lease_of_the_one_that_took_over(
    parties, mooncake_cluster
):
    """A reader dies holding the lease. Once it lapsed, B reads that lapsed lease
    and is held there; C takes the record over and holds it. B goes on: it must
    not get the record (the old takeover removed whatever lease was there, C's
    fresh one too, and both delivered). C's confirm then delivers it, once."""
    here, make = parties
    _send(here, "w1", 1.0)
    dead = make(lease_s=1.0)
    assert dead.request(op="start", call="claim", key="w1")["claimed"] is True
    dead.kill()
    _lapse(1.0)
    b, c = make(lease_s=600), make(lease_s=600)
    assert (
        b.request(op="start", call="claim", key="w1", hold_after_lease_read=True)["state"] == "held"
    )
    assert c.request(op="start", call="claim", key="w1")["claimed"] is True
    assert b.request(op="release")["claimed"] is False, "two live readers hold one record"
    assert c.request(op="start", call="confirm")["confirmed"] is True
    assert here.receive("w1") is None
    here.discard_matching(r"w1$")  # the payload (mailbox-level claims leave it)


def test_a_reader_killed_right_after_its_first_write_leaves_the_record_to_a_retry(
    parties, mooncake_cluster
):
    """A reader SIGKILLed right after its first write to the store (the old
    protocol's take of the record, before its lease was posted): the retry gets
    every byte once the dead reader's lease lapsed (the old one got None and the
    payload stayed until its TTL)."""
    here, make = parties
    _send(here, "w2", 2.0)
    reader = make(lease_s=1.0)
    assert (
        reader.request(op="start", call="receive", key="w2", hold_after_write=1)["state"] == "held"
    )
    reader.kill()
    got = here.receive_until("w2", time.monotonic() + 60)
    assert got is not None, "the record of a reader killed after its first write was lost"
    assert torch.equal(got[0]["t"], torch.full((NUMEL,), 2.0))
    del got


def test_a_replacing_send_held_before_its_second_write_takes_nothing_it_does_not_free(
    parties, mooncake_cluster
):
    """A's record is under the key; B's replacing send is held before its second
    write (the old protocol had taken A's record by then), C's send lands, then B
    goes on. Whatever B answers, no payload is orphaned: the consumer gets one
    record, and then the store is empty (the old B raised DuplicatePublishError
    and A's payload stayed forever)."""
    here, make = parties
    _send(here, "w3", 3.0)
    b, c = make(lease_s=600), make(lease_s=600)
    held = b.request(op="start", call="send", key="w3", numel=NUMEL, value=4.0, hold_before_write=2)
    assert held["state"] == "held"
    assert "sent" in c.request(op="start", call="send", key="w3", numel=NUMEL, value=5.0)
    b.request(op="release")
    got = here.receive("w3")
    assert got is not None and float(got[0]["t"][0]) in (4.0, 5.0)
    del got
    assert here.receive("w3") is None
    assert mooncake_cluster.keys() == [], "a replaced payload was orphaned"

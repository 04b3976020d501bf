"""KeyedHandoff and Mailbox against a real mooncake_master and store host.

Producer and consumer are separate KeyedHandoffs (own Store clients and
connectors); the bytes live in the store host process. The cross-process runs
are in tests/engines/vllm_omni, through the vLLM-Omni connector built on this.
"""

import socket
import time

import pytest
import torch

from mooncake_diffusion.errors import (
    DuplicatePublishError,
    MasterUnavailableError,
    StoreFullError,
)
from mooncake_diffusion.handoff.keyed import KeyedHandoff
from mooncake_diffusion.handoff.mailbox import Mailbox
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.testing import assert_no_leaks
from mooncake_diffusion.transfer.leases import TTL_ROOT, Reaper

pytestmark = pytest.mark.integration


@pytest.fixture
def pair(mooncake_cluster):
    import threading

    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    made = []

    def make(**kw):
        kh = KeyedHandoff(mooncake_cluster.settings, **kw)
        made.append(kh)
        return kh

    yield make
    for kh in made:
        kh.close()
    assert_no_leaks(mooncake_cluster, baseline)


def records(cluster) -> list[str]:
    """The store's keys less the mailbox's anchors and expiry markers (one anchor
    beside each record: ``handoff.protocol``)."""
    return sorted(k for k in cluster.keys() if not k.startswith(("mcd-mbox-anchor/", TTL_ROOT)))  # noqa: SIM118


def payload():
    return {
        "latent": torch.randn(1, 16, 4, 32, 32).to(torch.bfloat16),
        "ids": list(range(300)),
        "flag": torch.tensor(True),
    }


def test_found_by_key_alone_and_consumed_once(pair, mooncake_cluster):
    producer, consumer = pair(), pair()
    sent = payload()
    n = producer.send("req-1_0_0@0_1", sent)
    assert "mcd-mbox/req-1_0_0@0_1" in list(mooncake_cluster.keys())
    obj, size = consumer.receive("req-1_0_0@0_1")
    assert size == n and obj["ids"] == sent["ids"] and obj["flag"].item() is True
    assert torch.equal(obj["latent"], sent["latent"]) and obj["latent"].dtype == torch.bfloat16
    assert consumer.receive("req-1_0_0@0_1") is None
    assert mooncake_cluster.keys() == []


def test_small_objects_travel_in_the_record_alone(pair, mooncake_cluster):
    producer, consumer = pair(), pair()
    producer.send("tiny", {"a": [1, 2], "b": torch.arange(4)})
    assert records(mooncake_cluster) == ["mcd-mbox/tiny"]  # no payload objects at all
    obj, _ = consumer.receive("tiny")
    assert obj["a"] == [1, 2] and torch.equal(obj["b"], torch.arange(4))


def test_missing_key_is_none_and_a_second_send_replaces_an_untaken_one(pair, mooncake_cluster):
    producer, other, consumer = pair(), pair(), pair()
    assert consumer.receive("nothing") is None
    producer.send("k", {"x": 1})
    producer.send("k", {"x": 2})  # inline records: the second one wins
    assert consumer.receive("k")[0] == {"x": 2}
    producer.send("big", payload())
    first = set(mooncake_cluster.keys())
    sent = payload()
    other.send("big", sent)  # another producer, a reused key: its payload replaces
    assert not first & set(mooncake_cluster.keys()) - {"mcd-mbox/big"}  # old bytes gone
    obj, _ = consumer.receive("big")
    assert torch.equal(obj["latent"], sent["latent"])
    assert consumer.receive("big") is None


def test_discard_from_the_consumer_side_and_by_pattern(pair, mooncake_cluster):
    producer, consumer = pair(), pair()
    for i in range(3):
        producer.send(f"req-a_0_{i}@0_1", payload())
    producer.send("req-b_0_0@0_1", payload())
    consumer.discard("req-a_0_0@0_1")
    assert consumer.discard_matching(r"req\-a(_[^@]*)?@") == 2
    left = mooncake_cluster.keys()
    assert left and all("req-a" not in k for k in left), left
    assert consumer.receive("req-b_0_0@0_1") is not None


def test_store_mode_sends_outlive_a_clean_close_p2p_ones_do_not(pair, mooncake_cluster):
    keeper, consumer = pair(), pair()
    sent = payload()
    keeper.send("kept", sent)
    keeper.close()
    obj, _ = consumer.receive("kept")
    assert torch.equal(obj["latent"], sent["latent"])
    p2p = pair(transfer_mode="p2p")
    p2p.send("gone", payload())
    p2p.close()  # its bytes leave with it: the record goes too
    assert mooncake_cluster.keys() == []
    dropper = pair(keep_on_close=False)
    dropper.send("dropped", payload())
    dropper.close()
    assert mooncake_cluster.keys() == []


def test_reap_forgets_what_consumers_took(pair):
    producer, consumer = pair(), pair()
    for i in range(3):
        producer.send(f"r{i}", payload())
    consumer.receive("r0")
    consumer.receive("r2")
    assert producer.reap() == 2 and producer.pending() == ["r1"]
    consumer.receive("r1")


def test_receive_memory_is_reused_only_once_the_caller_dropped_it(pair):
    """Reuse follows the caller's last reference, with no garbage-collector pass (the
    collector is off while this runs: a cycle holding the tensors would show here)."""
    import gc

    gc.collect()
    gc.disable()
    try:
        _reuse_after_drop(pair)
    finally:
        gc.enable()


def _reuse_after_drop(pair) -> None:
    producer, consumer = pair(), pair()
    big = [{"x": torch.full((1 << 20,), float(i))} for i in range(3)]  # 4 MiB each
    producer.send("a", big[0])
    first, _ = consumer.receive("a")
    producer.send("b", big[1])
    second, _ = consumer.receive("b")  # "a" is still held: new memory, "a" untouched
    assert first["x"].data_ptr() != second["x"].data_ptr()
    assert torch.equal(first["x"], big[0]["x"]) and torch.equal(second["x"], big[1]["x"])
    ptr = first["x"].data_ptr()
    del first
    producer.send("c", big[2])
    third, _ = consumer.receive("c")  # lands in the memory "a" left behind
    assert third["x"].data_ptr() == ptr and torch.equal(third["x"], big[2]["x"])
    assert torch.equal(second["x"], big[1]["x"])
    assert consumer._recycled.allocations == 2


def test_p2p_mode_producer_holds_bytes_until_taken(pair, mooncake_cluster):
    producer, consumer = pair(transfer_mode="p2p"), pair(transfer_mode="p2p")
    sent = payload()
    producer.send("p", sent)
    assert records(mooncake_cluster) == ["mcd-mbox/p"]  # only the record is in the store
    obj, _ = consumer.receive("p")
    assert torch.equal(obj["latent"], sent["latent"])


def test_mailbox_post_take_and_dead_master():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = MooncakeSettings(master=f"127.0.0.1:{port}", connect_timeout_s=1)
    with pytest.raises(MasterUnavailableError, match=str(port)):
        Mailbox(dead)
    with pytest.raises(MasterUnavailableError):
        KeyedHandoff(dead)


def test_mailbox_records_round_trip(mooncake_cluster):
    with Mailbox(mooncake_cluster.settings, max_record=4096) as box:
        box.post("n1", b"hello")
        assert box.peek("n1") == b"hello"
        with pytest.raises(DuplicatePublishError):
            box.post("n1", b"again")
        assert box.post("n1", b"again", replace=True) == b"hello"
        assert box.take("n1") == b"again"
        assert box.take("n1") is None
        box.post("n2", b"x" * 4096, expires_at=time.time() + 600)
        keys = mooncake_cluster.keys()
        assert records(mooncake_cluster) == ["mcd-mbox/n2"]
        # the record, its anchor, and an expiry marker for each
        assert len(keys) == 4 and sum(k.startswith(TTL_ROOT) for k in keys) == 2
        assert box.take("n2") == b"x" * 4096  # the markers go with the record
    assert mooncake_cluster.keys() == []


def test_expired_sends_leave_nothing_records_inline_payloads_and_bytes(pair, mooncake_cluster):
    """Swept with a clock past the TTL (no waiting): the store host's reaper, or any
    process's, removes records, their markers and payload objects by key alone."""
    producer = pair(ttl_s=600, sweep_s=0)
    producer.send("inline", {"x": 1})
    producer.send("stored", payload())
    assert len(mooncake_cluster.keys()) > 4  # two records, two markers, payload objects
    assert Reaper(mooncake_cluster.settings).sweep(now=time.time() + 599) == 0
    Reaper(mooncake_cluster.settings).sweep(now=time.time() + 601)
    assert mooncake_cluster.keys() == []
    assert pair().receive("stored") is None


def test_an_expired_record_reads_as_absent_and_is_removed(pair, mooncake_cluster):
    producer, consumer = pair(ttl_s=0.2, sweep_s=0), pair(sweep_s=0)
    producer.send("late", payload())
    time.sleep(0.3)  # past the TTL (whether a reaper came by first or not)
    assert consumer.receive("late") is None
    assert mooncake_cluster.keys() == []


def test_a_crashed_producers_sends_are_reclaimed_with_no_call_at_all():
    """A producer SIGKILLed after sending, in a cluster whose store host runs no
    reaper: the consumer side's KeyedHandoff sweeps the expired record, marker and
    payload by itself; nobody calls discard, cleanup or close for them."""
    import sys
    import threading
    from pathlib import Path

    from mooncake_diffusion._mooncake.cluster import LocalCluster
    from mooncake_diffusion.platform.childproc import JsonLinesChild

    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    sender = [sys.executable, str(Path(__file__).with_name("keyed_sender.py")), "1"]
    with LocalCluster(pool_bytes=64 << 20, reap_interval_s=0) as cluster:
        child = JsonLinesChild(sender, cluster.settings, "keyed sender")
        try:
            assert child.request(op="send", key="orphan", numel=100_000, seed=1)["ok"]
            assert child.request(op="send", key="orphan-inline", numel=10, seed=2)["ok"]
        finally:
            child.kill()
            child.close()
        assert len(cluster.keys()) > 4
        with KeyedHandoff(cluster.settings, ttl_s=1, sweep_s=0.2):
            hang_guard = time.monotonic() + 120
            while cluster.keys() and time.monotonic() < hang_guard:
                time.sleep(0.05)
            assert cluster.keys() == []
        assert_no_leaks(cluster, baseline)


def test_a_clean_producer_exit_leaves_its_store_sends_for_the_consumer(pair, mooncake_cluster):
    import sys
    from pathlib import Path

    from mooncake_diffusion.platform.childproc import JsonLinesChild

    sender = [sys.executable, str(Path(__file__).with_name("keyed_sender.py")), "600"]
    child = JsonLinesChild(sender, mooncake_cluster.settings, "keyed sender")
    try:
        size = child.request(op="send", key="after-exit", numel=100_000, seed=3)["size"]
        assert child.request(op="shutdown")["ok"]
    finally:
        child.close()  # the process is gone
    obj, got = pair().receive("after-exit")
    g = torch.Generator().manual_seed(3)
    assert got == size and torch.equal(obj["t"], torch.randn(100_000, generator=g))


def test_a_full_pool_is_waited_for_within_timeout_s_then_a_typed_error():
    """A pool too small for two payloads: the second send waits while the first is
    untaken; taking the first makes room and the waiting send completes. With nobody
    taking, the send fails with StoreFullError after timeout_s and leaves nothing."""
    import threading

    from mooncake_diffusion._mooncake.cluster import LocalCluster

    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    big = torch.zeros(40 << 20, dtype=torch.uint8)  # 40 MiB of a 64 MiB pool
    with LocalCluster(pool_bytes=64 << 20, reap_interval_s=0) as cluster:
        producer = KeyedHandoff(cluster.settings, timeout_s=600, sweep_s=0)
        consumer = KeyedHandoff(cluster.settings, sweep_s=0)
        impatient = KeyedHandoff(cluster.settings, timeout_s=0.5, sweep_s=0)
        try:
            producer.send("first", {"t": big})
            with pytest.raises(StoreFullError, match="stayed full"):
                impatient.send("never", {"t": big})
            assert not any("never" in k for k in cluster.keys())  # noqa: SIM118
            done = threading.Event()
            second = threading.Thread(
                target=lambda: (producer.send("second", {"t": big + 1}), done.set())
            )
            second.start()
            hang_guard = time.monotonic() + 120
            while producer.full_waits == 0 and time.monotonic() < hang_guard:
                time.sleep(0.01)  # hold until the second send has met the full pool
            assert producer.full_waits > 0
            assert consumer.receive("first") is not None
            second.join()
            assert done.is_set()
            obj, _ = consumer.receive("second")
            assert torch.equal(obj["t"], big + 1)
        finally:
            for kh in (producer, consumer, impatient):
                kh.close()
        assert cluster.keys() == []
        assert_no_leaks(cluster, baseline)


def test_mailbox_take_is_exactly_once_across_processes(mooncake_cluster):
    """Four taker processes poll one name as the record lands, twenty times: each
    record goes to exactly one of them (a take that read it but lost the removal
    gets None)."""
    import sys
    import time
    from pathlib import Path

    from mooncake_diffusion.platform.childproc import JsonLinesChild

    taker = [sys.executable, str(Path(__file__).with_name("mailbox_taker.py"))]
    children = [JsonLinesChild(taker, mooncake_cluster.settings, f"taker {i}") for i in range(4)]
    try:
        with Mailbox(mooncake_cluster.settings, max_record=4096) as box:
            for trial in range(20):
                name = f"once-{trial}"
                for child in children:
                    assert child.request(op="go", name=name)["ok"]
                record = f"record {trial}".encode()
                box.post(name, record)
                hang_guard = time.monotonic() + 120
                while mooncake_cluster.keys() and time.monotonic() < hang_guard:
                    time.sleep(0.01)
                got = [child.request(op="stop")["got"] for child in children]
                assert [g for g in got if g is not None] == [record.hex()], (trial, got)
    finally:
        for child in children:
            child.close()
    assert mooncake_cluster.keys() == []


@pytest.mark.parametrize("at", ["claimed", "landed"])
def test_a_consumer_killed_mid_receive_leaves_the_payload_to_a_retry(pair, mooncake_cluster, at):
    """A consumer in its own process claims a 64 MiB payload and is held at a gate,
    before any byte was read (``claimed``) or with every byte read but not confirmed
    (``landed``), then SIGKILLed there. While its lease holds, nobody else gets the
    payload (exactly once to a live reader); once it lapsed, a retry gets every byte
    (at least once across the reader's death), and nothing is left in the store."""
    import sys
    from pathlib import Path

    from mooncake_diffusion.platform.childproc import JsonLinesChild

    producer, retry = pair(sweep_s=0), pair(sweep_s=0)
    sent = torch.randn(16 << 20)  # 64 MiB
    producer.send("held", {"t": sent})
    argv = [sys.executable, str(Path(__file__).with_name("keyed_receiver.py")), "15"]
    child = JsonLinesChild(argv, mooncake_cluster.settings, "keyed receiver")
    try:
        assert child.request(op="hold", key="held", at=at)["ok"]
        assert retry.receive("held") is None  # claimed by a live reader: not ours
    finally:
        child.kill()
        child.close()
    got = retry.receive_until("held", time.monotonic() + 120)
    assert got is not None, "the payload of a reader killed mid-receive was lost"
    assert torch.equal(got[0]["t"], sent)
    del got
    assert retry.receive("held") is None  # delivered once to the live retry: gone now
    assert mooncake_cluster.keys() == []


def test_two_producers_putting_one_key_at_once_leave_one_payload_and_no_orphan(
    pair, mooncake_cluster
):
    """Two producers (own clients) send 4 MiB under one key at the same instant, ten
    times: each send returns or raises DuplicatePublishError, the consumer gets one of
    the sent payloads, and once it did the store holds nothing."""
    import threading

    a, b, consumer = pair(sweep_s=0, ttl_s=600), pair(sweep_s=0, ttl_s=600), pair(sweep_s=0)
    for trial in range(10):
        start = threading.Barrier(2)
        sent: dict[str, torch.Tensor] = {}

        def put(kh, tag, trial=trial, start=start, sent=sent):
            t = torch.full((1 << 20,), float(trial * 2 + (tag == "b")))
            start.wait()
            try:
                kh.send("same", {"t": t, "tag": tag})
                sent[tag] = t
            except DuplicatePublishError:
                pass

        threads = [threading.Thread(target=put, args=(kh, tag)) for kh, tag in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sent, trial
        obj, _ = consumer.receive("same")
        assert obj["tag"] in sent and torch.equal(obj["t"], sent[obj["tag"]]), trial
        assert consumer.receive("same") is None
        assert mooncake_cluster.keys() == [], (trial, mooncake_cluster.keys())
        a.reap()
        b.reap()


def test_a_post_that_finds_another_record_raises_or_replaces_and_leaves_nothing_of_its_own(
    mooncake_cluster,
):
    """A poster whose put met another's record there: without ``replace`` it raises
    DuplicatePublishError and leaves no key of its own (anchor, markers); with
    ``replace`` it commits the other record (returned, so the caller frees what it
    named) and its own stands."""
    with (
        Mailbox(mooncake_cluster.settings, max_record=4096) as first,
        Mailbox(mooncake_cluster.settings, max_record=4096) as late,
    ):
        first.post("spot", b"first", expires_at=time.time() + 600)
        before = sorted(mooncake_cluster.keys())
        with pytest.raises(DuplicatePublishError, match="already holds"):
            late.post("spot", b"late", expires_at=time.time() + 900)
        assert sorted(mooncake_cluster.keys()) == before
        assert late.post("spot", b"late", expires_at=time.time() + 900, replace=True) == b"first"
        assert first.take("spot") == b"late"
        assert mooncake_cluster.keys() == []


@pytest.mark.parametrize("inline_bytes", [1 << 20, 1])
def test_numpy_arrays_of_every_shape_and_dtype_the_builtins_carry(
    pair, mooncake_cluster, inline_bytes
):
    """0-d arrays keep shape (); unicode, bytes, datetime and big-endian arrays come back
    equal, dtype and all, whether they ride inside the record or move as bytes."""
    import numpy as np

    arrays = {
        "zero_d": np.array(5.0),
        "zero_d_int": np.array(7, dtype=np.int32),
        "unicode": np.array(["ab", "c", "déjà"]),
        "bytes": np.array([b"x", b"yz"]),
        "dates": np.array(["2026-12-03", "1999-01-01"], dtype="datetime64[D]"),
        "big_endian": np.arange(6, dtype=">f4").reshape(2, 3),
        "empty_unicode": np.array([], dtype="<U3").reshape(0, 2),
        "strided": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
        "big_unicode": np.array(["q" * 100] * 1000),
    }
    producer, consumer = pair(inline_bytes=inline_bytes), pair()
    producer.send("np", arrays)
    got, _ = consumer.receive("np")
    for name, a in arrays.items():
        b = got[name]
        assert isinstance(b, np.ndarray), name
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        assert np.array_equal(a, b), name
    del got
    assert mooncake_cluster.keys() == []


def test_a_payload_larger_than_the_whole_pool_fails_at_once_saying_it_can_never_fit():
    """80 MiB into a 64 MiB pool: no wait for room that can never come (``full_waits``
    stays 0 although ``timeout_s`` allows a minute), a message that says so, nothing
    left; a payload that fits is still sent afterwards."""
    import threading

    from mooncake_diffusion._mooncake.cluster import LocalCluster

    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    with LocalCluster(pool_bytes=64 << 20, reap_interval_s=0) as cluster:
        with KeyedHandoff(cluster.settings, timeout_s=60, sweep_s=0) as kh:
            with pytest.raises(StoreFullError, match="can never fit") as e:
                kh.send("huge", {"t": torch.zeros(80 << 20, dtype=torch.uint8)})
            assert "67108864" in str(e.value)
            assert kh.full_waits == 0
            assert cluster.keys() == []
            kh.send("fits", {"t": torch.zeros(1 << 20, dtype=torch.uint8)})
            assert kh.receive("fits") is not None
        assert cluster.keys() == []
        assert_no_leaks(cluster, baseline)


def test_mailbox_claims_hold_lapse_and_are_discarded(mooncake_cluster):
    """A claimed record is nobody else's while its lease holds; once the lease lapsed
    exactly one later claim takes it over (the first claimer's confirm then says
    False); a discard removes a claimed record and its marker too."""
    with Mailbox(mooncake_cluster.settings, max_record=4096) as box:
        box.post("held", b"one", expires_at=time.time() + 600)
        claim = box.claim("held", 600)
        assert claim is not None and claim.record == b"one"
        assert box.claim("held", 600) is None and box.take("held") is None
        box.discard("held")
        assert mooncake_cluster.keys() == []
        assert claim.confirm() is False

        box.post("lapse", b"two", expires_at=time.time() + 600)
        first = box.claim("lapse", 0.05)
        hang_guard = time.monotonic() + 60
        while (second := box.claim("lapse", 600)) is None:
            assert time.monotonic() < hang_guard, "the lapsed lease was never taken over"
            time.sleep(0.01)
        assert second.record == b"two" and box.claim("lapse", 600) is None
        assert first.confirm() is False and second.confirm() is True
        assert mooncake_cluster.keys() == []


class FillablePool:
    """A 64 MiB store pool that ``fill()`` fills with hard-pinned objects (halving in
    size until not even one byte fits) and ``free()`` empties again: a full pool
    held exactly where a test needs it."""

    def __init__(self, cluster) -> None:
        import numpy as np

        from mooncake_diffusion._mooncake.store import StoreClient
        from mooncake_diffusion.memory.tensors import describe

        self.cluster, self.keys = cluster, []
        self.client = StoreClient(cluster.settings)
        self.blob = np.zeros(16 << 20, dtype=np.uint8)
        self._desc = describe("filler", self.blob)[1]
        self.client.regs.pin(self._desc)

    def fill(self) -> None:
        size = len(self.blob)
        while size >= 1:
            try:
                key = f"filler/{len(self.keys)}"
                self.client.put_many([key], [[self.blob.ctypes.data]], [[size]], pin="hard")
                self.keys.append(key)
            except StoreFullError:
                size //= 2

    def free(self) -> None:
        self.client.remove_many(self.keys)
        self.keys.clear()

    def close(self) -> None:
        self.free()
        self.client.regs.unpin(self._desc)
        self.client.close()


@pytest.fixture
def fillable():
    """A ``FillablePool`` on a cluster of its own, leak-checked after the test."""
    import threading

    from mooncake_diffusion._mooncake.cluster import LocalCluster

    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    with LocalCluster(pool_bytes=64 << 20, reap_interval_s=0) as cluster:
        pool = FillablePool(cluster)
        try:
            yield pool
        finally:
            pool.close()
        assert cluster.keys() == []
        assert_no_leaks(cluster, baseline)


def test_a_claim_that_meets_a_full_pool_goes_on_without_a_lease_and_delivers_once(
    fillable, monkeypatch
):
    """The pool filled just before a claim puts its lease slot (held there: the
    filling runs inside the claim's put): the claim goes on without a lease at once
    (counted), a second claimer may fetch too, and the commit delivers it to exactly
    one of them; nothing is left."""
    cluster = fillable.cluster
    with Mailbox(cluster.settings, max_record=4096) as box:
        record = b"r" * 2048
        box.post("full", record, expires_at=time.time() + 600)
        real_put, filled = box._put, []

        def put(items):
            if not filled and any(k.startswith(box.keys.slot_root) for k, _ in items):
                fillable.fill()
                filled.append(True)
            return real_put(items)

        monkeypatch.setattr(box, "_put", put)
        first = box.claim("full", 600)
        assert first is not None and first.record == record and not first.leased
        assert box.unleased_claims == 1
        second = box.claim("full", 600)
        assert second is not None and not second.leased
        assert first.confirm() is True and second.confirm() is False
        monkeypatch.undo()
        fillable.free()
        assert cluster.keys() == []

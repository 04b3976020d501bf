"""KeyedHandoff and Mailbox against a real mooncake_master and store host.

Producer and consumer are separate KeyedHandoffs (own Store clients and
connectors); the bytes live in the store host process. The cross-process runs
are in tests/engines/vllm_omni, through the vLLM-Omni connector built on this.
"""

import socket

import pytest
import torch

from mooncake_diffusion.errors import DuplicatePublishError, MasterUnavailableError
from mooncake_diffusion.keyed import KeyedHandoff
from mooncake_diffusion.mailbox import Mailbox
from mooncake_diffusion.settings import MooncakeSettings
from mooncake_diffusion.testing import assert_no_leaks

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
    assert mooncake_cluster.keys() == ["mcd-mbox/tiny"]  # no payload objects at all
    obj, _ = consumer.receive("tiny")
    assert obj["a"] == [1, 2] and torch.equal(obj["b"], torch.arange(4))


def test_missing_key_is_none_and_duplicate_key_is_refused(pair):
    producer, consumer = pair(), pair()
    assert consumer.receive("nothing") is None
    producer.send("k", {"x": 1})
    with pytest.raises(DuplicatePublishError):
        producer.send("k", {"x": 2})
    assert consumer.receive("k")[0] == {"x": 1}


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


def test_close_removes_untaken_sends_unless_kept(pair, mooncake_cluster):
    producer = pair()
    producer.send("gone", payload())
    producer.close()
    assert mooncake_cluster.keys() == []
    keeper, consumer = pair(keep_on_close=True), pair()
    keeper.send("kept", payload())
    keeper.close()
    assert consumer.receive("kept") is not None


def test_reap_forgets_what_consumers_took(pair):
    producer, consumer = pair(), pair()
    for i in range(3):
        producer.send(f"r{i}", payload())
    consumer.receive("r0")
    consumer.receive("r2")
    assert producer.reap() == 2 and producer.pending() == ["r1"]
    consumer.receive("r1")


def test_receive_memory_is_reused_only_once_the_caller_dropped_it(pair):
    import gc

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
    gc.collect()
    producer.send("c", big[2])
    third, _ = consumer.receive("c")  # lands in the memory "a" left behind
    assert third["x"].data_ptr() == ptr and torch.equal(third["x"], big[2]["x"])
    assert torch.equal(second["x"], big[1]["x"])
    assert consumer._recycled.allocations == 2


def test_p2p_mode_producer_holds_bytes_until_taken(pair, mooncake_cluster):
    producer, consumer = pair(transfer_mode="p2p"), pair(transfer_mode="p2p")
    sent = payload()
    producer.send("p", sent)
    assert mooncake_cluster.keys() == ["mcd-mbox/p"]  # only the record is in the store
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
        assert box.take("n1") == b"hello"
        assert box.take("n1") is None
    assert mooncake_cluster.keys() == []


def test_mailbox_take_is_exactly_once_across_processes(mooncake_cluster):
    """Four taker processes poll one name as the record lands, twenty times: each
    record goes to exactly one of them (a take that read it but lost the removal
    gets None)."""
    import sys
    import time
    from pathlib import Path

    from mooncake_diffusion.childproc import JsonLinesChild

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

"""The orchestrator subpackage's public surface and wire shape."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from mooncake_diffusion import orchestrator
from mooncake_diffusion.errors import MooncakeDiffusionError
from mooncake_diffusion.orchestrator import (
    Action,
    Cancel,
    Clock,
    Dispatch,
    Event,
    Heartbeat,
    ItemDone,
    ItemFailed,
    MonotonicClock,
    OrchestratorError,
    RegisterWorker,
    Rejected,
    RequestCompleted,
    Submit,
    Tick,
    VirtualClock,
    WorkerLost,
    WorkItem,
)

pytestmark = pytest.mark.unit


def test_every_public_name_resolves_and_errors_join_the_package_tree():
    assert len(orchestrator.__all__) == len(set(orchestrator.__all__))
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None, name
    for name in ("ClockError", "OrchestratorConfigError", "PolicyContractError"):
        err = getattr(orchestrator, name)
        assert issubclass(err, OrchestratorError) and issubclass(err, MooncakeDiffusionError)
        assert not err.retryable


def test_importing_it_loads_neither_mooncake_nor_torch_nor_threads():
    code = (
        "import sys, threading, mooncake_diffusion.orchestrator; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mooncake', 'torch')), "
        "threading.active_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 1"


def test_events_and_actions_cross_a_wire_as_a_tagged_union():
    events = [
        Submit("r", "batch", b"p", cached_embeddings=b"e", deadline=3.0),
        Cancel("r"),
        RegisterWorker("w", "decode", 2, {"node": "n0"}, heartbeat_timeout=5.0),
        Heartbeat("w", credits=3),
        WorkerLost("w"),
        ItemDone("w", "r", "decode", 1, b"out"),
        ItemFailed("w", "r", "decode", 1, "oom", retryable=False),
        Tick(),
    ]
    wire = msgspec.msgpack.encode(events)
    assert msgspec.msgpack.decode(wire, type=list[Event]) == events
    item = WorkItem("r", "decode", 1, "batch", 9.0, b"p", b"lat", {"node": "n0"})
    actions = [Dispatch("w", item), Rejected("not_held", "why", "ItemDone")]
    actions.append(RequestCompleted("r", b"v", 1.0, 2.0, 3.0))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(actions), type=list[Action])
    assert back == actions and back[2].deadline_met
    with pytest.raises(msgspec.ValidationError):  # a wire event's types are checked
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "Heartbeat", "x": 1}), type=Event)


def test_a_worker_progress_with_a_fractional_step_decodes_as_it_was_sent():
    """LightX2V reports ``progress_callback(33.33.., 100)``: a float step was encoded
    as such and refused on decode (``Expected int, got float - at $.step``)."""
    from mooncake_diffusion.orchestrator.link.wire import (
        ItemRef,
        Progress,
        decode_from_worker,
        encode,
    )

    sent = Progress("den-0", ItemRef("r", "denoise", 1), 100 / 3, 100.0)
    got = decode_from_worker(encode(sent))
    assert got == sent and (got.step, got.total) == (33, 100)
    assert type(got.step) is int and type(got.total) is int
    with pytest.raises((TypeError, ValueError)):
        Progress("den-0", ItemRef("r", "denoise", 1), "a third", 100)


def test_a_beat_carries_memory_and_one_without_it_still_decodes():
    """``Beat.memory`` was added to wire version 1 as an optional field: a beat from a
    worker that predates it decodes with ``memory`` None, and a service that predates
    it (a ``Beat`` without the field) reads a new beat and ignores the field."""
    from mooncake_diffusion.orchestrator.link import wire
    from mooncake_diffusion.wire.schema import Envelope

    new = wire.Beat("dec-0", (wire.ItemRef("r", "decode", 1),), 2, wire.Memory(1, 2, 3, 4))
    assert wire.decode_from_worker(wire.encode(new)) == new
    old_frame = msgspec.msgpack.encode({"type": "Beat", "worker_id": "dec-0", "credits": 2})
    env = Envelope(wire.MAGIC, wire.WIRE_VERSION, msgspec.Raw(old_frame))
    got = wire.decode_from_worker(msgspec.msgpack.encode(env))
    assert got == wire.Beat("dec-0", (), 2) and got.memory is None

    class OldBeat(msgspec.Struct, frozen=True, tag="Beat"):
        worker_id: str
        running: tuple[tuple[str, str, int], ...] = ()  # ItemRef is array-like
        credits: int | None = None

    body = msgspec.msgpack.encode(new)
    assert msgspec.msgpack.decode(body, type=OldBeat) == OldBeat("dec-0", (("r", "decode", 1),), 2)
    bad = msgspec.msgpack.encode({"type": "Beat", "worker_id": "w", "memory": [1, -2, 3, 4]})
    frame = msgspec.msgpack.encode(Envelope(wire.MAGIC, wire.WIRE_VERSION, msgspec.Raw(bad)))
    with pytest.raises(wire.WireError, match="memory"):  # a count is never negative
        wire.decode_from_worker(frame)


def test_clocks():
    assert isinstance(VirtualClock(), Clock) and isinstance(MonotonicClock(), Clock)
    c = VirtualClock(5.0)
    assert c.advance(1.5) == 6.5 and c.set(7.0) == 7.0 and c.now() == 7.0
    m = MonotonicClock()
    assert m.now() <= m.now()

"""The worker channel's wire schema: what a ``StageWorker`` and the service say over ZeroMQ.

Every message is one ZeroMQ frame: ``schema.Envelope`` ``[magic, version, body]``
with ``MAGIC`` and ``WIRE_VERSION``, the body a tagged msgspec struct. No pickle.
A decoder rejects another magic, another version and malformed bodies with
``WireError`` naming what was wrong; the service logs it and answers ``Refused``.

Call sequence (worker W, service S; W's ZeroMQ routing id is its worker id):

    W -> S  Hello      join the pools of ``stages`` (``stage`` first; ``fresh``: a new
                       process; what an older process of the same id held goes back
                       to its queue)
    S -> W  Welcome    accepted; heartbeat every ``heartbeat_interval`` seconds; with a
                       token, ``session``: the key the worker's later messages carry
    S -> W  Work       an item to run (may repeat: a worker ignores a copy of an item
                       it runs, and answers a copy of one it finished with its Done again)
    W -> S  Progress   optional, e.g. per denoise step (for status and event streams)
    W -> S  Done       output published; the item is acknowledged
    W -> S  Failed     the item is given up (``retryable=False`` fails the request)
    W -> S  Beat       alive; ``running`` lists what it holds, so the service re-sends
                       an item it dispatched that never arrived; ``memory``: what its
                       connector holds (``GET /v1/cluster``, ``/metrics``)
    S -> W  Drop       stop an item (its request was cancelled)
    S -> W  Yield      stop a denoise item at its next step boundary (preemption)
    W -> S  Yielded    it stopped as asked; it goes back to its queue
    S -> W  Release    the request finished: drop the payloads it published for it;
                       with ``item`` (the request failed or was cancelled after that
                       denoise attempt): also drop what would resume it (``Resumable``)
    S -> W  Refused    a message was not accepted, and why (``code`` as the core's)
    W -> S  Leave      it is leaving (SIGTERM with notice): the core's ``Drain``; its
                       denoise items get ``Yield``, the others finish (or come back
                       as ``Yielded``); it says ``Bye`` once it holds nothing
    S -> W  Load       the core's ``LoadStages``: it holds nothing; load ``stages``'
                       models, then say ``Hello`` again (``fresh=False``) with the new
                       ``stages`` and ``load_s``, the seconds loading took
    S -> W  Retire     it was drained (``Drain`` from the service, or its own
                       ``Leave``) and holds nothing: exit
    W -> S  Bye        leaving (drained); nothing it holds is lost

Version history: 1 (initial; ``Release.item`` added later, optional with a
default, so a decoder that predates it reads such a frame and ignores it; so
were ``Hello.stages``, ``Hello.load_s``, ``Beat.memory``, ``Welcome.session``
and every later worker message's ``session`` (checked only where a token is set:
there both sides must be of this build); ``Leave``, ``Load`` and ``Retire``
are new messages, which a peer that predates them refuses as a bad frame, so a
stage change or a drain needs both sides of this build).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.wire.schema import Envelope

__all__ = [
    "MAGIC",
    "WIRE_VERSION",
    "Beat",
    "Bye",
    "Done",
    "Drop",
    "Failed",
    "Hello",
    "ItemRef",
    "Leave",
    "Load",
    "Memory",
    "Progress",
    "Refused",
    "Release",
    "Retire",
    "Welcome",
    "WireError",
    "Work",
    "Yield",
    "Yielded",
    "decode_from_service",
    "decode_from_worker",
    "encode",
]

MAGIC = "mcd-orch"
WIRE_VERSION = 1
#: Largest frame either side accepts (handles are <= 64 KiB; this leaves room).
MAX_FRAME = 1 << 20

Info = dict[str, str | int | float | bool]


class WireError(ValueError):
    """A frame that is not a valid message of this wire version; the text says why."""


class ItemRef(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    stage: str
    attempt: int


# ------------------------------------------------------------------ worker -> service
class Hello(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    stage: str
    credits: int = 1
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    heartbeat_timeout: float | None = None
    token: str = ""
    fresh: bool = True
    #: every stage it holds, ``stage`` first (empty: ``stage`` alone)
    stages: tuple[str, ...] = ()
    #: after a ``Load``: the seconds loading the new stages took
    load_s: float | None = None


_Count = Annotated[int, msgspec.Meta(ge=0)]


class Memory(msgspec.Struct, frozen=True, array_like=True):
    """What a worker's connector holds (``DiffusionConnector.stats()``), as of the
    worker's last look: bytes registered with the Transfer Engine, receive-pool bytes
    handed out, bytes held back because a producer may still write into them (a p2p
    fetch broken off mid-transfer: receive pool and outside it, until the
    transport's ``late_write_s`` has passed), and its live publications."""

    registered_bytes: _Count
    pool_bytes_in_use: _Count
    late_write_bytes: _Count
    live_publications: _Count


class Beat(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    running: tuple[ItemRef, ...] = ()
    credits: int | None = None
    #: what its connector holds (None: not known yet, or a worker that predates it)
    memory: Memory | None = None
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""


class Progress(msgspec.Struct, frozen=True, tag=True):
    """``step`` of ``total``, whole numbers on the wire: a fractional step (an engine
    that reports a percentage, as LightX2V's ``progress_callback(33.3, 100)`` does) is
    rounded down when made, so what is encoded always decodes."""

    worker_id: str
    item: ItemRef
    step: int
    total: int
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""

    def __post_init__(self) -> None:
        for name in ("step", "total"):
            value = getattr(self, name)
            if type(value) is not int:
                msgspec.structs.force_setattr(self, name, int(value))


class Done(msgspec.Struct, frozen=True, tag=True):
    """``info``: small facts for the client's event stream (bytes moved, path, cache hit)."""

    worker_id: str
    item: ItemRef
    output: bytes = b""
    info: Info = msgspec.field(default_factory=dict)
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""


class Failed(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    item: ItemRef
    reason: str
    retryable: bool = True
    input_lost: bool = False  # the item's input payload is gone (see ItemFailed)
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""


class Yielded(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    item: ItemRef
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""


class Leave(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    reason: str = "leaving"
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""


class Bye(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    reason: str = "drained"
    #: the key of this connection's ``Welcome`` (with a token; "" without one)
    session: str = ""


# ------------------------------------------------------------------ service -> worker
class Welcome(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    heartbeat_interval: float
    #: with a token: the key every later frame of this worker carries (``session``), so
    #: that a connection that took the worker's id without its Hello is refused
    session: str = ""


class Work(msgspec.Struct, frozen=True, tag=True):
    item: WorkItem


class Drop(msgspec.Struct, frozen=True, tag=True):
    item: ItemRef
    reason: str


class Yield(msgspec.Struct, frozen=True, tag=True):
    item: ItemRef
    reason: str


class Release(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    item: WorkItem | None = None


class Load(msgspec.Struct, frozen=True, tag=True):
    stages: tuple[str, ...]
    reason: str = ""


class Retire(msgspec.Struct, frozen=True, tag=True):
    reason: str = ""


class Refused(msgspec.Struct, frozen=True, tag=True):
    code: str
    reason: str
    about: str


FromWorker = Hello | Beat | Progress | Done | Failed | Yielded | Leave | Bye
FromService = Welcome | Work | Drop | Yield | Load | Retire | Release | Refused

_enc = msgspec.msgpack.Encoder()
_env = msgspec.msgpack.Decoder(Envelope)
_from_worker = msgspec.msgpack.Decoder(FromWorker)
_from_service = msgspec.msgpack.Decoder(FromService)


def encode(msg: FromWorker | FromService) -> bytes:
    """One frame: the message inside the versioned envelope."""
    return _enc.encode(Envelope(MAGIC, WIRE_VERSION, msgspec.Raw(_enc.encode(msg))))


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder) -> object:
    if len(frame) > MAX_FRAME:
        raise WireError(f"frame of {len(frame)} bytes is over the {MAX_FRAME}-byte limit")
    try:
        env = _env.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not an orchestrator message: {e}") from None
    if env.magic != MAGIC:
        raise WireError(f"not an orchestrator message (magic {env.magic!r})")
    if env.version != WIRE_VERSION:
        raise WireError(
            f"wire version {env.version}; this build speaks only version {WIRE_VERSION}"
        )
    try:
        return decoder.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"bad message body: {e}") from None


def decode_from_worker(frame: bytes) -> FromWorker:
    """Raises ``WireError``."""
    return _decode(frame, _from_worker)  # type: ignore[return-value]


def decode_from_service(frame: bytes) -> FromService:
    """Raises ``WireError``."""
    return _decode(frame, _from_service)  # type: ignore[return-value]

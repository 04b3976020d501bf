"""The wire schema: every control message that crosses a process boundary.

Typed, frozen msgspec structs encoded as compact msgpack arrays. Never pickle;
tensor bytes never travel here, only where they are and how they are laid out.

A handle on the wire is ``[MAGIC, SCHEMA_VERSION, body]``. ``decode_handle``
checks the magic (a foreign object), the version (an unknown producer), then
decodes the body with full validation (dtype names, shapes, byte ranges, size
limits) and raises ``HandleError`` naming what is wrong.

Version history:
    1  first version: TensorSpec, PayloadHandle (with chunk_dim/num_chunks) and
       P2PSource | StoreSource | MemorySource; FetchRequest, ChunkDone and
       FetchReply on the p2p side channel.
    2  lease ``retained``: hard-pinned like ``delete_on_consume``, but reading it
       does not remove it (a re-queued stage can read its input again); the
       producer releases it when the request ends.
    3  ``StoreSource.part_bytes``: a store chunk larger than this is stored as
       several objects of at most this many bytes (0: one object per chunk), so
       no single read outlives its lease.
    4  ``StoreSource.notify``: the producer's side-channel endpoint that streams a
       ``ChunkDone`` per committed chunk to a consumer that asks (a ``FetchRequest``
       naming only the payload), so a chunked store relay wakes on commits instead
       of polling.
    5  ``FetchRequest.budget_s``: the seconds the consumer will wait, from when the
       producer receives the request; the producer starts no chunk's write after
       them (a consumer that gave up holds its memory back from its deadline on).
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Literal

import msgspec

from mooncake_diffusion.errors import HandleError

__all__ = [
    "DTYPE_SIZES",
    "MAGIC",
    "SCHEMA_VERSION",
    "ChunkDone",
    "Envelope",
    "FetchReply",
    "FetchRequest",
    "Kind",
    "LeaseMode",
    "MemorySource",
    "P2PSource",
    "PayloadHandle",
    "StoreSource",
    "TensorSpec",
    "check_chunking",
    "decode_handle",
    "decode_message",
    "encode",
]

MAGIC = "mcd"
SCHEMA_VERSION = 5

#: Element size in bytes of every dtype a handle may carry.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

Kind = Literal["embedding", "latent", "feature", "checkpoint"]
LeaseMode = Literal["delete_on_consume", "shared", "retained"]

MAX_TENSORS = 64
MAX_RANK = 8
MAX_NAME = 128
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: far above any real latent, far below overflow
MAX_META_BYTES = 8192
MAX_RANGES = 4096


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return False


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a payload: layout plus the byte ranges that hold its data.

    ``strides`` are in elements, like torch's. ``ranges`` are ``(offset, length)``
    pairs in bytes from the tensor's first element, sorted and disjoint; for a
    contiguous tensor it is the single range ``(0, nbytes)``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        _check(0 < len(self.name) <= MAX_NAME, f"tensor name length must be 1..{MAX_NAME}")
        _check(self.dtype in DTYPE_SIZES, f"unsupported dtype {self.dtype!r}")
        _check(len(self.shape) <= MAX_RANK, f"rank {len(self.shape)} exceeds {MAX_RANK}")
        _check(len(self.strides) == len(self.shape), "strides and shape differ in length")
        _check(all(d >= 0 for d in self.shape), f"negative dimension in shape {self.shape}")
        _check(self.nbytes <= MAX_TENSOR_BYTES, f"tensor of {self.nbytes} bytes is too large")
        _check(len(self.ranges) <= MAX_RANGES, "too many byte ranges")
        end = 0
        total = 0
        for off, length in self.ranges:
            _check(off >= end and length > 0, f"byte ranges overlap or are empty: {self.ranges}")
            end = off + length
            total += length
        _check(total == self.nbytes, f"byte ranges cover {total} bytes, tensor has {self.nbytes}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


MAX_CHUNKS = 1024


def check_chunking(
    tensors: tuple[TensorSpec, ...] | list[TensorSpec], chunk_dim: int | None, num_chunks: int
) -> None:
    """Raise ``ValueError`` unless every tensor can be cut ``num_chunks`` ways along
    ``chunk_dim`` (non-negative; ``None`` means unchunked, with ``num_chunks`` 1)."""
    if chunk_dim is None:
        _check(num_chunks == 1, "num_chunks needs a chunk_dim")
        return
    _check(1 <= num_chunks <= MAX_CHUNKS, f"num_chunks must be 1..{MAX_CHUNKS}")
    for t in tensors:
        _check(
            0 <= chunk_dim < len(t.shape),
            f"chunk_dim {chunk_dim} is out of range for tensor {t.name!r} of rank {len(t.shape)}",
        )
        _check(
            num_chunks <= t.shape[chunk_dim],
            f"{num_chunks} chunks is more than dim {chunk_dim} of tensor {t.name!r} "
            f"(size {t.shape[chunk_dim]})",
        )


class P2PSource(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """Bytes stay in the producer's registered memory until a consumer fetches them.

    ``segment`` is the producer's Transfer Engine segment (``ip:rpc_port``),
    ``endpoint`` the ``host:port`` of its side channel that serves fetches.
    """

    segment: str
    endpoint: str


class StoreSource(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """Bytes live in Mooncake Store under ``prefix``: one object per (tensor, chunk),
    split into parts of at most ``part_bytes`` (0: never split); see
    ``transports.store``. ``notify`` is the producer's side-channel endpoint that
    tells a consumer each chunk as it is committed ("": none, the consumer polls);
    the bytes never depend on it."""

    prefix: str
    part_bytes: int = 0
    notify: str = ""

    def __post_init__(self) -> None:
        if self.part_bytes < 0:
            raise ValueError(f"part_bytes must not be negative, got {self.part_bytes}")


class MemorySource(msgspec.Struct, frozen=True, array_like=True, tag=3):
    """The in-process fake transport: bytes live in a dict inside one process."""

    fabric: str


class PayloadHandle(msgspec.Struct, frozen=True, array_like=True):
    """The small, serializable reference to one published payload.

    It travels in queue messages; the bytes it names move through a transport.
    """

    payload_id: str
    request_id: str
    kind: Kind
    transport: Literal["p2p", "store", "memory"]
    lease: LeaseMode
    tensors: tuple[TensorSpec, ...]
    source: P2PSource | StoreSource | MemorySource
    meta_json: str = "{}"
    ttl_s: float | None = None
    chunk_dim: int | None = None
    num_chunks: int = 1
    expires_at: float | None = None  # unix seconds; None: no TTL

    def __post_init__(self) -> None:
        _check(0 < len(self.request_id) <= 256, "request_id length must be 1..256")
        _check(0 < len(self.payload_id) <= 512, "payload_id length must be 1..512")
        _check(len(self.tensors) <= MAX_TENSORS, f"more than {MAX_TENSORS} tensors")
        names = [t.name for t in self.tensors]
        _check(len(set(names)) == len(names), f"duplicate tensor names in {names}")
        _check(len(self.meta_json) <= MAX_META_BYTES, "meta is larger than 8 KiB")
        _check(_is_json_object(self.meta_json), "meta_json must be a JSON object")
        _check(self.ttl_s is None or self.ttl_s > 0, "ttl_s must be positive")
        check_chunking(self.tensors, self.chunk_dim, self.num_chunks)
        kinds = {"p2p": P2PSource, "store": StoreSource, "memory": MemorySource}
        _check(
            isinstance(self.source, kinds[self.transport]),
            f"transport {self.transport!r} with a {type(self.source).__name__}",
        )

    @property
    def meta(self) -> dict:
        return json.loads(self.meta_json)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def expired(self, now: float | None = None) -> bool:
        """Whether the payload's TTL has passed (never, without one)."""
        return self.expires_at is not None and (now or time.time()) >= self.expires_at

    def encode(self) -> bytes:
        """The handle as bytes for a queue message (see ``decode_handle``)."""
        return encode(self)


class FetchRequest(msgspec.Struct, frozen=True, array_like=True, tag=10):
    """Consumer -> producer on the p2p side channel: write the payload into my buffers.

    ``addrs``/``lengths`` are the consumer's registered destinations, one per
    tensor in handle order (0/0 for an empty tensor). ``host``/``pid`` identify
    the consumer process for the same-host path ("" / 0: use the network);
    ``pool_*`` describe its shared receive pool (fd -1: none). ``budget_s``: how
    long the consumer waits, counted from when the producer receives this; the
    producer starts no chunk after that (0: no limit).
    """

    payload_id: str
    segment: str
    addrs: tuple[int, ...]
    lengths: tuple[int, ...]
    host: str = ""
    pid: int = 0
    pool_fd: int = -1
    pool_token: str = ""
    pool_base: int = 0
    pool_size: int = 0
    budget_s: float = 0.0


class ChunkDone(msgspec.Struct, frozen=True, array_like=True, tag=12):
    """Producer -> consumer: chunk ``index`` has landed in the consumer's buffers.

    Zero or more precede the final ``FetchReply``; ``path`` is ``net`` or ``shm``.
    """

    index: int
    path: str = "net"


class FetchReply(msgspec.Struct, frozen=True, array_like=True, tag=11):
    """Producer -> consumer: ``status`` is ``ok``, ``gone``, ``consumed``, ``mismatch`` or
    ``failed``; ``detail`` explains any status but ``ok``."""

    status: Literal["ok", "gone", "consumed", "mismatch", "failed"]
    detail: str = ""


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """``[magic, version, body]``: every versioned object on a wire or in the store."""

    magic: str
    version: int
    body: msgspec.Raw


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_handle_decoder = msgspec.msgpack.Decoder(PayloadHandle)
_message_decoder = msgspec.msgpack.Decoder(FetchRequest | FetchReply | ChunkDone)


def encode(obj: PayloadHandle | FetchRequest | FetchReply | ChunkDone) -> bytes:
    """Encode a schema object inside the versioned envelope."""
    return _encoder.encode(Envelope(MAGIC, SCHEMA_VERSION, msgspec.Raw(_encoder.encode(obj))))


def _open(data: bytes | bytearray | memoryview, what: str) -> msgspec.Raw:
    try:
        env = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"not a mooncake-diffusion {what}: {e}") from None
    if env.magic != MAGIC:
        raise HandleError(f"not a mooncake-diffusion {what} (magic {env.magic!r})")
    if env.version != SCHEMA_VERSION:
        raise HandleError(
            f"{what} has schema version {env.version}; this build reads only version "
            f"{SCHEMA_VERSION} (upgrade the older side)"
        )
    return env.body


def _named(error: Exception) -> str:
    """Name the handle field in a msgspec error path (array-encoded: ``$[2]`` -> kind)."""
    fields = PayloadHandle.__struct_fields__
    return re.sub(
        r"`\$\[(\d+)\]",
        lambda m: f"`{fields[int(m[1])]}" if int(m[1]) < len(fields) else m[0],
        str(error),
    )


def decode_handle(data: bytes | bytearray | memoryview) -> PayloadHandle:
    """Decode and validate a handle; raises ``HandleError`` on anything unexpected."""
    body = _open(data, "handle")
    try:
        return _handle_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"invalid handle: {_named(e)}") from None


def decode_message(
    data: bytes | bytearray | memoryview,
) -> FetchRequest | FetchReply | ChunkDone:
    """Decode a side-channel message; raises ``HandleError`` on anything unexpected."""
    body = _open(data, "message")
    try:
        return _message_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"invalid side-channel message: {e}") from None

"""One cache entry in Mooncake Store: a data object, then a metadata object.

For an entry key ``K`` (``keys.py``):

    K + "/data"   the tensors' bytes, concatenated in metadata order, each
                  C-contiguous, no padding; absent when every tensor is empty
    K + "/meta"   exactly META_BYTES bytes: a u32 little-endian length L, then L
                  bytes of msgpack ``["mcd-cache", META_VERSION, EntryMeta]``,
                  then zeros. Fixed-size, so a reader fetches it in one get
                  without first asking its size (Store reads need the exact size).

Both are soft-pinned: evicted last, but evictable; nothing depends on them for
correctness. A writer puts data first and metadata last, so a reader that
finds metadata knows the data was complete (a Store put is atomic per object).
Store ``put`` never overwrites, so two processes writing one key race safely:
the first of each object wins and both hold the same content. Eviction works
per object: metadata without data is a miss, and the next write repairs it.

    store = EntryStore(client, device="cpu")     # pins a 2 x META_BYTES scratch
    store.write(key, owner, tensors)             # data, then metadata
    meta, tensors = store.read(key, owner, dst)  # metadata, then data
    store.remove(key); store.close()

Thread-safe. ``EntryMeta``'s fields, in msgpack array order: kind ("emb",
"cfg" or "ckpt"), key, owner (encoder id or model id), version (encoder version;
the sampler name for "ckpt"; "" for "cfg"), tensors (``TensorSpec`` arrays),
data_bytes, created (unix seconds).

Metadata format history:
    1  first version; kind "ckpt" (step checkpoints) added later, same layout.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from mooncake_diffusion._mooncake.codes import OBJECT_ALREADY_EXISTS
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.caches.errors import CacheEntryError, CacheMismatchError
from mooncake_diffusion.errors import MooncakeDiffusionError, MooncakeError, PayloadError
from mooncake_diffusion.memory.tensors import (
    Region,
    check_destination,
    describe,
    empty_buffer,
    view_of,
)
from mooncake_diffusion.wire.schema import MAX_TENSORS, Envelope, TensorSpec

__all__ = [
    "DEFAULT_NAME",
    "META_BYTES",
    "META_MAGIC",
    "META_VERSION",
    "CacheStats",
    "EntryMeta",
    "EntryStore",
    "Owner",
    "decode_meta",
    "encode_meta",
    "named_tensors",
]

META_MAGIC = "mcd-cache"
META_VERSION = 1
META_BYTES = 8192
#: The name a bare tensor is stored under.
DEFAULT_NAME = "tensor"
_ALIGN = 64  # offset of each tensor inside a buffer the cache allocates
_LEN = struct.Struct("<I")


class EntryMeta(msgspec.Struct, frozen=True, array_like=True):
    """What an entry holds; validated at decode (see the module docstring)."""

    kind: Literal["emb", "cfg", "ckpt"]
    key: str
    owner: str
    version: str
    tensors: tuple[TensorSpec, ...]
    data_bytes: int
    created: float

    def __post_init__(self) -> None:
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"more than {MAX_TENSORS} tensors")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in {names}")
        if self.data_bytes != sum(t.nbytes for t in self.tensors):
            raise ValueError(f"data_bytes {self.data_bytes} differs from the tensors' sum")

    def layout(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple((t.name, t.dtype, t.shape) for t in self.tensors)


@dataclass(frozen=True)
class Owner:
    """Whose entries a cache reads and writes; a stored entry must name the same."""

    kind: Literal["emb", "cfg", "ckpt"]
    owner: str
    version: str = ""

    def describe(self) -> str:
        if self.kind == "emb":
            return f"encoder {self.owner!r} version {self.version!r}"
        if self.kind == "ckpt":
            return f"model {self.owner!r} sampler {self.version!r}"
        return f"model {self.owner!r}"


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_meta_decoder = msgspec.msgpack.Decoder(EntryMeta)


def encode_meta(meta: EntryMeta) -> bytes:
    """The META_BYTES-long metadata object; ``PayloadError`` when it does not fit."""
    env = _encoder.encode(Envelope(META_MAGIC, META_VERSION, msgspec.Raw(_encoder.encode(meta))))
    if _LEN.size + len(env) > META_BYTES:
        raise PayloadError(
            f"entry metadata takes {len(env)} bytes, over the {META_BYTES - _LEN.size} a "
            "metadata object holds: use fewer tensors or shorter names"
        )
    return _LEN.pack(len(env)) + env + bytes(META_BYTES - _LEN.size - len(env))


def decode_meta(data: bytes | bytearray | memoryview, key: str) -> EntryMeta:
    """Decode a metadata object read from ``key``; ``CacheEntryError`` if it is not one."""
    data = memoryview(data)
    if len(data) < _LEN.size:
        raise CacheEntryError(f"cache metadata {key!r} is truncated")
    (n,) = _LEN.unpack_from(data)
    if not 0 < n <= len(data) - _LEN.size:
        raise CacheEntryError(f"cache metadata {key!r} claims {n} bytes; not a cache entry")
    try:
        env = _envelope_decoder.decode(data[_LEN.size : _LEN.size + n])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CacheEntryError(f"cache metadata {key!r} is not a cache entry: {e}") from None
    if env.magic != META_MAGIC:
        raise CacheEntryError(f"cache metadata {key!r} is foreign (magic {env.magic!r})")
    if env.version != META_VERSION:
        raise CacheEntryError(
            f"cache metadata {key!r} has format version {env.version}; this build reads "
            f"only version {META_VERSION}"
        )
    try:
        return _meta_decoder.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CacheEntryError(f"cache metadata {key!r} is invalid: {e}") from None


def named_tensors(tensors: Any, what: str = "tensors") -> dict[str, Any]:
    """A bare tensor as ``{DEFAULT_NAME: t}``; a mapping as a dict (names checked later)."""
    if isinstance(tensors, Mapping):
        if not tensors:
            raise PayloadError(f"{what} is empty")
        for name in tensors:
            if not isinstance(name, str):
                raise PayloadError(f"{what} has a non-string name {name!r}")
        return dict(tensors)
    return {DEFAULT_NAME: tensors}


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was made.

    ``hits``/``misses`` count lookups (a ``get_or_compute`` is one lookup).
    ``puts`` counts entries handed to the store (putting an entry that is already
    there is a no-op in the store but still counted). ``bytes_read`` and
    ``bytes_written`` count tensor bytes, not metadata. ``errors`` counts failures
    of the store or of stored entries, raised or absorbed by a best-effort call,
    never the caller's bad input; ``last_error`` describes the latest.
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    errors: int = 0
    last_error: str = ""

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Counters:
    """The mutable, thread-safe side of ``CacheStats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v: dict[str, Any] = dict.fromkeys(
            ("hits", "misses", "bytes_read", "bytes_written", "puts", "errors"), 0
        )
        self._v["last_error"] = ""

    def add(self, **delta: int) -> None:
        with self._lock:
            for k, d in delta.items():
                self._v[k] += d

    def error(self, e: BaseException) -> None:
        with self._lock:
            self._v["errors"] += 1
            self._v["last_error"] = f"{type(e).__name__}: {e}"

    def snapshot(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._v)


class EntryStore:
    """Reads and writes entries through one ``StoreClient`` (see module docstring).

    Owns a pinned 2 x META_BYTES scratch (one registration) for metadata; every
    other registration is temporary and released before a call returns.
    """

    def __init__(self, client: StoreClient, *, device: str = "cpu") -> None:
        self.client = client
        self.device = device
        self._scratch = np.zeros(2 * META_BYTES, dtype=np.uint8)
        _, self._scratch_region = describe("scratch", self._scratch)
        client.regs.pin(self._scratch_region)
        self._in_ptr = self._scratch_region.ptr
        self._out_ptr = self._scratch_region.ptr + META_BYTES
        self._in_lock = threading.Lock()
        self._out_lock = threading.Lock()

    # ------------------------------------------------------------------ read
    def read_meta(self, key: str, owner: Owner) -> EntryMeta | None:
        """The entry's metadata, or ``None`` when absent (or still being written)."""
        with self._in_lock:
            found = self.client.get_many([key + "/meta"], [[self._in_ptr]], [[META_BYTES]])
            if not found[0]:
                return None
            raw = self._scratch[:META_BYTES].tobytes()
        meta = decode_meta(raw, key + "/meta")
        if meta.key != key:
            raise CacheEntryError(f"cache metadata under {key!r} names another key {meta.key!r}")
        if (meta.kind, meta.owner, meta.version) != (owner.kind, owner.owner, owner.version):
            writer = Owner(meta.kind, meta.owner, meta.version).describe()
            raise CacheMismatchError(
                f"cache entry {key!r} was written by {writer}, but this cache is for "
                f"{owner.describe()}: a foreign or corrupt entry (remove it)"
            )
        return meta

    def read_data(self, meta: EntryMeta, dst: Any = None) -> dict[str, Any] | None:
        """The entry's tensors in ``dst`` (validated) or in a new buffer; ``None`` when
        the data object is gone (evicted or removed since the metadata was read)."""
        specs = meta.tensors
        if dst is not None:
            if not isinstance(dst, Mapping) and len(specs) == 1:
                targets = {specs[0].name: dst}  # a bare tensor for a one-tensor entry
            else:
                targets = named_tensors(dst, "dst")
            if set(targets) != {s.name for s in specs}:
                raise PayloadError(
                    f"dst names {sorted(targets)} differ from the entry's tensors "
                    f"{[s.name for s in specs]}"
                )
            regions = [check_destination(s, targets[s.name]) for s in specs]
            out = {s.name: targets[s.name] for s in specs}
        else:
            offsets, total = [], 0
            for s in specs:
                offsets.append(total)
                total += -(-s.nbytes // _ALIGN) * _ALIGN
            buf = empty_buffer(max(total, 1), self.device)
            _, whole = describe("buffer", buf)
            regions = [
                Region(whole.ptr + off, s.nbytes, buf, whole.device, *whole.extent)
                for s, off in zip(specs, offsets, strict=True)
            ]
            out = {s.name: view_of(buf, off, s) for s, off in zip(specs, offsets, strict=True)}
        if meta.data_bytes and not self._get_data(meta.key, regions):
            return None
        return out

    def _get_data(self, key: str, regions: list[Region]) -> bool:
        used = [r for r in regions if r.nbytes]
        leases = []
        try:
            for r in used:
                leases.append(self.client.regs.acquire(r))
            ptrs, sizes = [r.ptr for r in used], [r.nbytes for r in used]
            # get_many takes one list of buffers per key (its annotation says int)
            return self.client.get_many([key + "/data"], [ptrs], [sizes])[0]
        finally:
            for lease in leases:
                self.client.regs.release(lease)

    # ----------------------------------------------------------------- write
    def prepare(self, key: str, owner: Owner, tensors: Any) -> tuple[EntryMeta, list[Region]]:
        """Validate ``tensors`` and build the entry's metadata; touches nothing in the store."""
        named = named_tensors(tensors)
        specs, regions = [], []
        for name, t in named.items():
            spec, region = describe(name, t)
            specs.append(spec)
            regions.append(region)
        try:
            meta = EntryMeta(
                owner.kind,
                key,
                owner.owner,
                owner.version,
                tuple(specs),
                sum(s.nbytes for s in specs),
                time.time(),
            )
        except ValueError as e:
            raise PayloadError(f"cannot cache these tensors: {e}") from None
        encode_meta(meta)  # raises before any write when the metadata cannot fit
        return meta, regions

    def write(self, meta: EntryMeta, regions: list[Region]) -> None:
        """Put data, then metadata (both soft-pinned); on failure remove what this call
        put and raise. A put of an existing object is a no-op in the store."""
        key = meta.key
        blob = encode_meta(meta)
        if meta.data_bytes:
            used = [r for r in regions if r.nbytes]
            leases = []
            try:
                for r in used:
                    leases.append(self.client.regs.acquire(r))
                self._put(key + "/data", [r.ptr for r in used], [r.nbytes for r in used])
            finally:
                for lease in leases:
                    self.client.regs.release(lease)
        try:
            with self._out_lock:
                self._scratch[META_BYTES:] = np.frombuffer(blob, dtype=np.uint8)
                self._put(key + "/meta", [self._out_ptr], [META_BYTES])
        except BaseException:
            if meta.data_bytes:
                with contextlib.suppress(MooncakeDiffusionError):  # the put's error matters
                    self.client.remove_many([key + "/data"])
            raise

    def _put(self, key: str, ptrs: list[int], sizes: list[int]) -> None:
        try:
            self.client.put_many([key], [ptrs], [sizes], pin="soft")
        except MooncakeError as e:
            if e.code != OBJECT_ALREADY_EXISTS:  # another writer got there first: fine
                raise

    # ---------------------------------------------------------------- remove
    def remove(self, key: str) -> None:
        """Remove one entry (metadata first, so no reader finds it half gone)."""
        self.client.remove_many([key + "/meta"])
        self.client.remove_many([key + "/data"])

    def close(self) -> None:
        """Drop the scratch registration (the client itself belongs to the caller)."""
        self.client.regs.unpin(self._scratch_region)

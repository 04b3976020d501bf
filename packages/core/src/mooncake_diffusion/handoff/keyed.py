"""Key-addressed handoff of Python objects that hold tensors.

For engines whose consumer knows only a key (vLLM-Omni's connectors): the
producer publishes the object's tensors through ``DiffusionConnector`` and
posts a small record (the payload handle plus the object's non-tensor
"skeleton") in a ``Mailbox`` under that key; the consumer takes the record by
the key alone and consumes the tensors into memory that it hands over (recycled
registered buffers that no live tensor uses, see ``recycle.py``).

Call sequence (one ``KeyedHandoff`` per process side; thread-safe):

    kh = KeyedHandoff(settings, transfer_mode="store")  # connects; fails fast
    nbytes = kh.send(key, obj)      # producer; blocks until the consumer can take it
    got = kh.receive(key)           # consumer: (obj, nbytes), or None at once
    kh.discard(key)                 # either side: drop key's record and bytes
    kh.discard_matching(pattern)    # either side: every key matching a regex
    kh.reap()                       # producer: forget keys consumers took (bounded, cheap)
    kh.close()                      # drops what this side sent and nobody took

What an object may hold: dicts, lists, tuples (received as lists), str, int,
float, bool, None, bytes, bytearray and memoryview (all received as ``bytes``),
msgspec Structs and dataclasses (both received as dicts unless their class is
registered), numpy scalars (received as Python numbers), torch tensors and numpy
arrays (received as the same kind, dtype and shape, on ``device``), and
instances of classes registered in ``mooncake_diffusion.wire.carried`` (received as
the same class, rebuilt from a type tag and their state: ``slice`` and
``PIL.Image`` built in, engines' output classes registered by their adapters).
Anything else raises ``PayloadError`` before anything is sent. No pickle.

How bytes move. Tensors and top-level raw bytes of at least ``inline_bytes``
move through the connector's zero-copy path (store: ``put_from`` from the
caller's memory, ``get_into`` the destination; a non-contiguous tensor
is made contiguous first, the one copy this module makes). Smaller ones, at
most 63 of them past the first 63 large ones, travel inside the skeleton,
because one store object costs a round trip (~0.7 ms here) that a copy of a
few KiB does not. The skeleton (msgpack; tensors as Ext type 1, registered
classes as Ext type 2 holding ``(tag, state)``) rides in the record when it is at
most half of ``Mailbox.max_record``, else as one more tensor. Top-level raw bytes
that moved are received into a bytearray and returned as ``bytes`` (one copy).

Lifecycle. A record is delivered once, under the mailbox's delivery rule
(``Mailbox``; ``handoff.protocol`` states it and the tests' explorer checks it
through every interleaving and crash point): the consumer claims it under a
lease of ``lease_s``, fetches the bytes (store payloads are written
``retained``, so a read alone removes nothing), then confirms, and the confirm
removes the payload's store keys in the same round trip as the commit. A
consumer that dies or stalls past its lease before confirming delivers
nothing (a stalled one's ``receive`` raises ``LeaseLapsedError``) and leaves
the record to the next ``receive``, which takes the lease over: exactly once
to a consumer that confirms within its lease, and no record lost to a
consumer's death. A second ``send`` to a key whose record no consumer holds
replaces it (the old payload removed with the replace's commit), as the
built-in shared-memory connector overwrites a segment; of several sends racing
on one key each either stands (possibly replaced at once by a later one, whose
caller then frees it) or raises ``DuplicatePublishError`` with nothing of it
left in the store. A payload
larger than the store's whole pool fails at once (``StoreFullError``).
With ``ttl_s`` set, the payload's store keys carry the expiry and the record an
expiry marker (``leases``), so whatever nobody took is removed once ``ttl_s``
has passed, with no ``discard`` or ``close`` call from anyone, also when the
producer crashed: every
``KeyedHandoff`` runs a ``leases.Reaper`` sweep every ``sweep_s`` (one listing
of the master's keys, at most ``SWEEP_BUDGET`` removals a pass), as does the
store host of ``LocalCluster``; any one of them is enough. A consumer treats
an expired record as absent, removes it and logs a warning (an expiry is a
payload lost, never silent). In store mode a producer's ``close`` leaves its
untaken sends for their consumers (the bytes live in the store, not in the
producer); in p2p mode it removes them (their bytes die with the producer).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import msgspec
import numpy as np

from mooncake_diffusion._mooncake.master import pool_capacity
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.errors import (
    HandleError,
    LeaseLapsedError,
    MooncakeDiffusionError,
    PayloadError,
    StoreFullError,
)
from mooncake_diffusion.handoff.mailbox import Claim, Mailbox
from mooncake_diffusion.memory.recycle import RecycledBuffers
from mooncake_diffusion.memory.tensors import _is_torch, view_of
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.connector import DiffusionConnector, TransferMode
from mooncake_diffusion.transfer.leases import Reaper
from mooncake_diffusion.transfer.payload import StagePayload
from mooncake_diffusion.transfer.transports.store import KEY_ROOT
from mooncake_diffusion.wire import carried
from mooncake_diffusion.wire.schema import (
    DTYPE_SIZES,
    MAX_TENSORS,
    Envelope,
    PayloadHandle,
    decode_handle,
)

__all__ = ["RECORD_MAGIC", "RECORD_VERSION", "KeyedHandoff", "KeyedRecord", "pack", "unpack"]

RECORD_MAGIC = "mcd-keyed"
#: Record format history: 1 first version; 2 registered classes as Ext type 2; 3 numpy
#: dtypes by their full str ('<U5', '>f4'), arrays of other dtypes moved as raw bytes.
RECORD_VERSION = 3
EXT_TENSOR = 1
EXT_OBJECT = 2
_SKELETON = "skeleton"
_ALIGN = 64
_LEDGER_MAX = 65536
_RECYCLE_MIN = 1 << 20  # host receive buffers from here up come from RecycledBuffers
_FULL_BACKOFF_S = (0.005, 0.5)  # first and longest wait between puts into a full pool
_LEASE_MARGIN_S = 5.0  # a receive's lease: its transfer's timeout_s plus this
_log = logging.getLogger("mooncake_diffusion.keyed")


class KeyedRecord(msgspec.Struct, frozen=True, array_like=True):
    """What a mailbox record holds. ``handle`` is an encoded ``PayloadHandle`` (b"" when
    everything is inline); ``skeleton`` the msgpack tree (b"" when it travels as the
    payload tensor ``"skeleton"``); ``nbytes`` the size reported to callers."""

    handle: bytes
    skeleton: bytes
    nbytes: int
    expires_at: float | None = None


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(KeyedRecord)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_ext_decoder = msgspec.msgpack.Decoder(tuple[str, str, tuple[int, ...], bytes | int])
_ObjectExt = tuple[str, dict[str, Any]]
_LEAVES = (str, int, float, bool, bytes, type(None))


class _Tagged:
    """A registered instance msgspec would encode by itself, marked so the hook gets it."""

    __slots__ = ("entry", "obj")

    def __init__(self, entry: carried.CarriedType, obj: Any) -> None:
        self.entry = entry
        self.obj = obj


def _mark(obj: Any) -> Any:
    """``obj`` with every instance of a registered dataclass/Struct class wrapped in
    ``_Tagged`` (msgspec encodes those itself, so its hook would never see them).
    Containers are rebuilt only where something inside changed; an unregistered
    dataclass or Struct holding a registered instance becomes a dict of its fields
    (what msgspec would have sent)."""
    t = type(obj)
    if t in _LEAVES:
        return obj
    entry = carried.carried_for(obj)
    if entry is not None:
        return _Tagged(entry, obj) if entry.native else obj
    if t is dict:
        out = None
        for k, v in obj.items():
            m = _mark(v)
            if m is not v:
                out = dict(obj) if out is None else out
                out[k] = m
        return obj if out is None else out
    if t is list or t is tuple:
        items = None
        for i, v in enumerate(obj):
            if type(v) in _LEAVES:
                continue
            m = _mark(v)
            if m is not v:
                items = list(obj) if items is None else items
                items[i] = m
        return obj if items is None else items
    if isinstance(obj, msgspec.Struct) or (is_dataclass(obj) and not isinstance(obj, type)):
        if isinstance(obj, msgspec.Struct):
            names: Any = obj.__struct_fields__
        else:
            names = [f.name for f in fields(obj)]
        state = {n: getattr(obj, n) for n in names}
        marked = _mark(state)
        return obj if marked is state else marked
    return obj


# ------------------------------------------------------------------ object trees
def pack(
    obj: Any, inline_bytes: int, *, to_host: bool = False
) -> tuple[bytes, list[tuple[str, Any]]]:
    """``obj`` -> (skeleton, tensors to move); see the module docstring for the rules.

    Each tensor to move is ``(kind, t)``: kind ``torch``, ``numpy`` or ``bytes``, ``t`` a
    contiguous torch tensor or numpy array; the payload names index ``i`` ``f"t{i}.{kind}"``.
    ``to_host`` copies device tensors to host memory first (for Mooncake builds that
    cannot register device memory). Keeps no reference to ``obj`` or its tensors once
    the caller drops the result.
    """
    packer = _Packer(inline_bytes, to_host)
    if isinstance(obj, bytes | bytearray | memoryview) and len(obj) >= inline_bytes:
        flat = np.frombuffer(obj, dtype=np.uint8)
        ext = packer.place("bytes", flat, "uint8", (len(flat),), len(flat))
        return _encoder.encode(ext), packer.moved
    try:
        target = _mark(obj) if packer.native else obj
        skeleton = msgspec.msgpack.encode(target, enc_hook=packer.hook)
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise PayloadError(f"cannot send this object without pickle: {e}") from None
    return skeleton, packer.moved


class _Packer:
    """One ``pack`` call's state. A class rather than nested closures on purpose: a
    closure that calls itself (nested objects) is a reference cycle, and one holding
    the tensors keeps them (and, on the consumer, their recycled buffer) alive until
    the next garbage-collector pass instead of the caller's last reference."""

    def __init__(self, inline_bytes: int, to_host: bool) -> None:
        self.inline_bytes = inline_bytes
        self.to_host = to_host
        self.native = carried.native_carried()
        self.moved: list[tuple[str, Any]] = []

    def place(self, kind: str, t: Any, dtype: str, shape: tuple[int, ...], nbytes: int) -> Any:
        moved = self.moved
        if nbytes >= self.inline_bytes and len(moved) < MAX_TENSORS - 1:
            moved.append((kind, t))
            return msgspec.msgpack.Ext(
                EXT_TENSOR, _encoder.encode((kind, dtype, shape, len(moved) - 1))
            )
        raw = _raw_bytes(kind, t)
        return msgspec.msgpack.Ext(EXT_TENSOR, _encoder.encode((kind, dtype, shape, raw)))

    def hook(self, o: Any) -> Any:
        if _is_torch(o):
            t = o.detach()
            if self.to_host and t.device.type != "cpu":
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            return self.place("torch", t, dtype, tuple(t.shape), t.numel() * t.element_size())
        if isinstance(o, np.ndarray):
            if o.dtype.kind in "OV":
                raise TypeError(f"numpy arrays of dtype {o.dtype} cannot travel")
            a = o if o.flags.c_contiguous else np.ascontiguousarray(o)  # ndim >= 1
            if not (a.dtype.isnative and a.dtype.name in DTYPE_SIZES):
                a = a.reshape(-1).view(np.uint8)  # strings, dates, other byte orders
            # the dtype by its full str ('<U5', '>f4'), the shape the caller's (0-d too)
            return self.place("numpy", a, o.dtype.str, tuple(o.shape), o.nbytes)
        if isinstance(o, np.generic):
            return o.item()
        entry, target = (o.entry, o.obj) if isinstance(o, _Tagged) else (None, o)
        entry = entry or carried.carried_for(o)
        if entry is not None:
            state = entry.to_state(target)
            if self.native:
                state = _mark(state)
            inner = msgspec.msgpack.encode((entry.tag, state), enc_hook=self.hook)
            return msgspec.msgpack.Ext(EXT_OBJECT, inner)
        raise TypeError(f"objects of type {type(o).__module__}.{type(o).__qualname__}")


def _raw_bytes(kind: str, t: Any) -> bytes:
    if kind == "torch":
        import torch

        flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        return flat.cpu().numpy().tobytes()
    return np.ascontiguousarray(t).tobytes()


def unpack(skeleton: bytes | memoryview, moved: dict[int, Any]) -> Any:
    """The inverse of ``pack``: ``moved[i]`` is the received tensor ``i``. Keeps no
    reference to ``moved``'s tensors once the caller drops the result (see ``_Packer``:
    the consumer's recycled receive buffers come back on the caller's last reference)."""
    unpacker = _Unpacker(moved)
    try:
        return msgspec.msgpack.decode(skeleton, ext_hook=unpacker.ext)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"corrupt keyed record skeleton: {e}") from None


class _Unpacker:
    """One ``unpack`` call's state (a class, not a self-calling closure: see ``_Packer``)."""

    def __init__(self, moved: dict[int, Any]) -> None:
        self.moved = moved

    def ext(self, code: int, data: memoryview) -> Any:
        moved = self.moved
        if code == EXT_OBJECT:
            tag, state = msgspec.msgpack.decode(data, type=_ObjectExt, ext_hook=self.ext)
            entry = carried.by_tag(tag)
            try:
                return entry.from_state(entry.cls, state)
            except HandleError:
                raise
            except Exception as e:
                raise HandleError(f"keyed record: cannot rebuild a {tag!r}: {e}") from None
        if code != EXT_TENSOR:
            raise HandleError(f"unknown msgpack extension {code} in a keyed record")
        kind, dtype, shape, where = _ext_decoder.decode(data)
        if isinstance(where, int):
            if where not in moved:
                raise HandleError(f"keyed record names tensor {where}, which did not arrive")
            got = moved[where]
            if kind == "bytes":
                return got if isinstance(got, bytes) else bytes(got)
            if kind == "numpy" and (got.dtype.str != dtype or got.shape != shape):
                return _numpy_view(got, dtype, shape)  # moved as raw bytes, or 0-d
            return got
        return _from_raw(kind, dtype, shape, where)


def _numpy_view(got: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """The moved array ``got`` (raw uint8 bytes, or a same-dtype array of another
    shape) as ``dtype`` and ``shape``; ``HandleError`` when its bytes do not fit."""
    try:
        ndt = np.dtype(dtype)
        return got.reshape(-1).view(np.uint8).view(ndt).reshape(shape)
    except (TypeError, ValueError, SyntaxError) as e:
        raise HandleError(f"keyed record: moved numpy array {dtype}{list(shape)}: {e}") from None


def _from_raw(kind: str, dtype: str, shape: tuple[int, ...], raw: bytes) -> Any:
    """An inline tensor; raises ``HandleError`` when kind, dtype, shape and byte count
    do not describe one (a corrupt or foreign record)."""
    if kind == "bytes":
        return bytes(raw)
    what = f"keyed record: inline {kind} tensor {dtype}{list(shape)}"
    if kind not in ("torch", "numpy") or len(shape) > 32 or any(d < 0 for d in shape):
        raise HandleError(f"{what} is not a tensor this build reads")
    if kind == "torch":
        import torch

        tdt = getattr(torch, dtype, None)
        if not isinstance(tdt, torch.dtype):
            raise HandleError(f"{what}: unknown torch dtype")
        itemsize = tdt.itemsize
    else:
        try:
            ndt = np.dtype(dtype)
        except (TypeError, ValueError, SyntaxError):
            raise HandleError(f"{what}: unknown numpy dtype") from None
        if ndt.kind in "OV":
            raise HandleError(f"{what}: numpy dtype of kind {ndt.kind!r} cannot travel")
        itemsize = ndt.itemsize
    if math.prod(shape) * itemsize != len(raw):
        raise HandleError(f"{what} comes with {len(raw)} bytes")
    if kind == "numpy":
        return np.frombuffer(raw, dtype=ndt).reshape(shape).copy()
    if not raw:
        return torch.empty(shape, dtype=tdt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdt).reshape(shape)


# ------------------------------------------------------------------ the handoff
def _safe(key: str) -> str:
    """``key`` as a request id: no '/', at most 200 characters (long keys hashed)."""
    s = key.replace("%", "%25").replace("/", "%2F")
    return s if len(s) <= 200 else s[:180] + "~" + uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:16]


class KeyedHandoff:
    """Send and receive objects by key (see the module docstring).

    ``transfer_mode`` is the connector's: ``store`` (bytes outlive the producer),
    ``p2p`` (the producer holds them until consumed; it must stay up and leave the
    tensors unchanged until then) or ``auto`` (store here: no consumer is named).
    Construction connects the mailbox's store client and raises
    ``MasterUnavailableError`` within ``settings.connect_timeout_s`` when no master
    answers. ``device`` is where received tensors are allocated; ``to_host`` copies
    device tensors to host memory before sending (see ``pack``). Host receives of at
    least 1 MiB land in recycled registered buffers (``recycle.RecycledBuffers``):
    one is reused only after every tensor returned from it is gone, and at most
    ``receive_cache_bytes`` of idle ones are kept.

    ``ttl_s``: how long what nobody took is kept (``None``: until taken or
    discarded). ``sweep_s``: seconds between this process's reaper sweeps (``None``:
    ``ttl_s / 4`` within 1..60 s when a TTL is set, else no sweeps; ``0``: none).
    ``keep_on_close`` (``None``: true except in p2p mode): whether ``close`` leaves
    untaken sends for their consumers. ``timeout_s`` bounds a send, including the
    wait for room when the store pool is full, and a receive's transfer.
    ``lease_s`` (``None``: ``timeout_s`` + 5 s): how long a receive's claim on a
    record lasts before another consumer may take the record over (see ``receive``).
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        transfer_mode: TransferMode = "store",
        role: str = "denoise",
        inline_bytes: int = 64 << 10,
        max_record: int = 1 << 20,
        ttl_s: float | None = None,
        timeout_s: float = 30.0,
        device: str = "cpu",
        keep_on_close: bool | None = None,
        to_host: bool = False,
        receive_cache_bytes: int = 512 << 20,
        sweep_s: float | None = None,
        lease_s: float | None = None,
    ) -> None:
        if inline_bytes < 1:
            raise PayloadError(f"inline_bytes must be >= 1, got {inline_bytes}")
        self.settings = settings
        self.transfer_mode = transfer_mode
        self.inline_bytes = inline_bytes
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.device = device
        self.keep_on_close = transfer_mode != "p2p" if keep_on_close is None else keep_on_close
        self.to_host = to_host
        if sweep_s is None:
            sweep_s = min(max(ttl_s / 4, 1.0), 60.0) if ttl_s else 0.0
        self.sweep_s = sweep_s
        #: how long a receive's claim holds before another consumer may take it over
        self.lease_s = timeout_s + _LEASE_MARGIN_S if lease_s is None else lease_s
        #: records this side found expired (each a payload nobody took within ttl_s)
        self.expired = 0
        #: sends that found the store pool full and waited for room (once per retry)
        self.full_waits = 0
        #: receives whose bytes landed after their lease lapsed (nothing delivered)
        self.lapsed = 0
        self._lock = threading.Lock()
        # key -> request id of its payload ("" when inline): sent, not yet seen taken.
        # Holds no tensors: store payloads left them behind, p2p holds live in core.
        self._sent: OrderedDict[str, str] = OrderedDict()
        self._closed = False
        self._client: StoreClient | None = None
        self._mailbox: Mailbox | None = None
        self._conn: DiffusionConnector | None = None
        self._recycled: RecycledBuffers | None = None
        self._reaper: Reaper | None = None
        # probes the master first: fails fast. Mailbox records and reaping only: no
        # direct reads (``read()`` never uses them), so no second Transfer Engine
        self._client = StoreClient(dataclasses.replace(settings, store_direct_reads=False))
        try:
            self._mailbox = Mailbox(settings, max_record=max_record, client=self._client)
            self._conn = DiffusionConnector(
                role, transfer_mode, settings, receive_pool_bytes=0, timeout_s=timeout_s
            )
            if device == "cpu":
                self._recycled = RecycledBuffers(
                    self._conn.register, self._conn.unregister, idle_bytes=receive_cache_bytes
                )
            if sweep_s > 0:
                self._reaper = Reaper(settings, sweep_s, client=self._client).start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ producer
    def send(self, key: str, obj: Any) -> int:
        """Publish ``obj`` under ``key`` and return its size in bytes once a consumer can
        take it. A record under ``key`` that nobody took yet is replaced (its payload
        removed). While the store pool is full, retries with backoff until
        ``timeout_s`` has passed, then raises ``StoreFullError``. Raises
        ``PayloadError`` for objects that cannot travel, ``DuplicatePublishError`` when
        another send of ``key`` landed at the same instant (that one stands), and the
        connector's errors; after an error nothing of ``obj`` is left in the store."""
        box, conn = self._open()
        skeleton, moved = pack(obj, self.inline_bytes, to_host=self.to_host)
        tensors = {f"t{i}.{kind}": t for i, (kind, t) in enumerate(moved)}
        inline = len(skeleton) <= box.max_record // 2  # the rest of a record: the handle
        if not inline:
            tensors[_SKELETON] = np.frombuffer(skeleton, dtype=np.uint8)
        nbytes = len(skeleton) + sum(_nbytes(t) for _, t in moved)
        deadline = time.monotonic() + self.timeout_s
        delay, longest = _FULL_BACKOFF_S
        asked = False  # the pool's size is asked once, at the first full
        while True:
            try:
                rid = self._send_once(box, conn, key, tensors, skeleton if inline else b"", nbytes)
                break
            except StoreFullError as e:
                capacity = None if asked else pool_capacity(self.settings)
                asked = True
                if capacity is not None and nbytes > capacity:
                    raise StoreFullError(
                        f"{key!r} is {nbytes} bytes, more than the store's whole pool "
                        f"({capacity} bytes): it can never fit; not sent"
                    ) from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreFullError(
                        f"the store pool stayed full for {self.timeout_s}s; {key!r} not sent ({e})"
                    ) from None
                self.full_waits += 1
                time.sleep(min(delay, left))
                delay = min(delay * 2, longest)
        with self._lock:
            self._sent[key] = rid
            self._sent.move_to_end(key)
            while len(self._sent) > _LEDGER_MAX:
                self._sent.popitem(last=False)
        return nbytes

    def _send_once(
        self,
        box: Mailbox,
        conn: DiffusionConnector,
        key: str,
        tensors: dict[str, Any],
        skeleton: bytes,
        nbytes: int,
    ) -> str:
        """One attempt of ``send``; returns the payload's request id ("" when inline)."""
        expires_at = time.time() + self.ttl_s if self.ttl_s else None
        pub = None
        if tensors:
            rid = f"{_safe(key)}~{uuid.uuid4().hex[:8]}"
            pub = conn.publish(
                StagePayload(
                    request_id=rid,
                    kind="feature",
                    tensors=tensors,
                    ttl_s=self.ttl_s,
                    # store: a read leaves the bytes; the consumer removes them once its
                    # claim is confirmed (a reader dying mid-read leaves them for a retry)
                    lease="delete_on_consume" if self.transfer_mode == "p2p" else "retained",
                )
            )
        try:
            if pub is not None:
                pub.wait(self.timeout_s)
                expires_at = pub.handle.expires_at
            handle = pub.encode() if pub is not None else b""
            record = KeyedRecord(handle, skeleton, nbytes, expires_at)
            env = _encoder.encode(Envelope(RECORD_MAGIC, RECORD_VERSION, _raw(record)))
            old = box.post(
                key, env, expires_at=expires_at, replace=True, also_of=self._payload_keys_of
            )
        except BaseException:
            if pub is not None:
                pub.release()
            raise
        if old is not None:  # an untaken earlier send under this key: drop its bytes
            self._drop_payload_of(old, key)
        return pub.handle.request_id if pub is not None else ""

    def _payload_keys_of(self, raw: bytes) -> tuple[str, ...]:
        """The store keys of the payload a record names (none for a foreign one)."""
        try:
            record = _decode_record(raw, "")
            if not record.handle:
                return ()
            return self._open()[1].payload_keys(decode_handle(record.handle))
        except MooncakeDiffusionError:
            return ()

    def _drop_payload_of(self, raw: bytes, key: str) -> None:
        """Free what a replaced record names: this side's hold of it (its store keys
        went with the replace's commit; removing them again costs nothing)."""
        try:
            record = _decode_record(raw, key)
            if record.handle:
                self._open()[1].drop(decode_handle(record.handle))
        except MooncakeDiffusionError as e:  # foreign record: nothing of ours to free
            _log.warning("replaced record under %r: %s", key, e)

    # ------------------------------------------------------------ consumer
    def receive(self, key: str, *, deadline: float | None = None) -> tuple[Any, int] | None:
        """Take ``key``'s object: ``(obj, nbytes)``, or ``None`` at once when nothing is
        posted under ``key`` (or what is there expired). The record is claimed under a
        lease of ``lease_s`` and confirmed once the bytes have landed: a key is delivered
        to exactly one consumer that confirms within its lease; a consumer that dies (or
        stalls past the lease) before confirming leaves the key to the next ``receive``,
        which takes the lease over. Raises ``LeaseLapsedError`` when this receive's
        bytes landed after its lease lapsed (nothing delivered; the record stays),
        ``PayloadGoneError`` when the record was there but its bytes were not (producer
        died in p2p, removed meanwhile), ``HandleError`` for a foreign or corrupt
        record, and the connector's transfer errors. After a retryable error of a store
        payload (e.g. ``TransferError`` for a read lease that expired under load) the
        lease is given back, so a later receive retries at once; after any other error
        the record and its payload are removed. ``deadline``: wait for the record until then
        (``time.monotonic()``) instead of answering ``None`` at once."""
        box, conn = self._open()
        if deadline is None:
            claim = box.claim(key, self.lease_s, lease_if=_has_handle)
        else:
            claim = box.claim_until(key, deadline, self.lease_s, lease_if=_has_handle)
        if claim is None:
            return None
        try:
            record = _decode_record(claim.record, key)
        except BaseException:
            claim.confirm()
            raise
        if record.expires_at is not None and time.time() >= record.expires_at:
            keys = conn.payload_keys(decode_handle(record.handle)) if record.handle else ()
            claim.confirm(also=keys)
            self.expired += 1
            _log.warning("%r expired before anyone took it: dropped", key)
            return None
        if not record.handle:
            claim.confirm()
            return unpack(record.skeleton, {}), record.nbytes
        try:
            handle = decode_handle(record.handle)
        except BaseException:
            claim.confirm()
            raise
        try:
            dst, finish = _destinations(handle, self.device, self._recycled)
            with conn.consume(handle, dst=dst) as got:
                got.wait()
        except MooncakeDiffusionError as e:
            if e.retryable and handle.transport == "store" and claim.give_back():
                raise  # the record is claimable again: a later receive tries again
            self._commit(claim, handle)  # whatever of it is still in the store goes
            raise
        except BaseException:
            self._commit(claim, handle)
            raise
        if not self._commit(claim, handle):
            self.lapsed += 1
            raise LeaseLapsedError(
                f"{key!r}: the bytes landed here but the lease ({self.lease_s}s) lapsed "
                "before the confirm, or a replace or discard ended the record first: "
                "nothing delivered here; the record stays for the next receive"
            )
        moved, skeleton = finish()
        return unpack(record.skeleton or skeleton, moved), record.nbytes

    def _commit(self, claim: Claim, handle: PayloadHandle) -> bool:
        """Confirm ``claim``, removing its payload's store keys in the same round trip;
        ``False`` when it was not delivered here (the payload is then left alone)."""
        conn = self._open()[1]
        if not claim.confirm(also=conn.payload_keys(handle)):
            return False
        if handle.transport != "store":
            conn.drop(handle)
        return True

    def receive_until(self, key: str, deadline: float) -> tuple[Any, int] | None:
        """``receive`` polled with bounded backoff until ``deadline`` (``time.monotonic``);
        ``None`` when nothing arrived by then."""
        while True:  # an expired record reads as absent: keep waiting for a fresh one
            got = self.receive(key, deadline=deadline)
            if got is not None or time.monotonic() >= deadline:
                return got

    # ------------------------------------------------------------ cleanup
    def discard(self, key: str) -> None:
        """Remove ``key``'s record and payload, from either side; absent keys are fine."""
        box, conn = self._open()
        with self._lock:
            rid = self._sent.pop(key, None)
        if rid:
            conn.cleanup(rid)
        raw = box.discard(key)  # commits it: a reader holding it then fails its confirm
        if raw is not None:
            record = _decode_record(raw, key)
            if record.handle:
                conn.drop(decode_handle(record.handle))

    def discard_matching(self, pattern: str) -> int:
        """Remove every record whose key matches the regex ``pattern`` (anchored at the
        start; end it with ``$`` for exact keys), the store payloads of every key whose
        '/'- and '%'-escaped form matches, and this side's p2p holds of matching keys;
        returns the number of records removed. One scan of the master's keys each."""
        box, conn = self._open()
        rx = re.compile(pattern)
        with self._lock:
            rids = [self._sent.pop(k) for k in [k for k in self._sent if rx.match(k)]]
        for rid in rids:
            if rid:
                conn.cleanup(rid)
        n = box.discard_matching(pattern)
        data = pattern[:-1] + "~" if pattern.endswith("$") else pattern
        assert self._client is not None
        self._client.remove_regex("^" + re.escape(KEY_ROOT) + data)
        return n

    def reap(self, budget: int = 64) -> int:
        """Forget up to ``budget`` of the oldest sent keys whose record a consumer has
        taken (one batched existence check); returns how many were forgotten. Bounded:
        cheap enough to call on every iteration of a send loop."""
        box, _ = self._open()
        with self._lock:
            oldest = list(itertools.islice(self._sent, budget))
        if not oldest:
            return 0
        assert self._client is not None
        there = self._client.exists_many([box.key_of(k) for k in oldest])
        with self._lock:
            for key, present in zip(oldest, there, strict=True):
                if present:
                    self._sent.move_to_end(key)
                else:
                    self._sent.pop(key, None)
        return there.count(False)

    def pending(self) -> list[str]:
        """Keys this side sent that it has not yet seen taken (see ``reap``)."""
        with self._lock:
            return list(self._sent)

    def stats(self) -> Any:
        """The connector's ``ConnectorStats`` (leak checks)."""
        return self._open()[1].stats()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Remove this side's untaken sends (unless ``keep_on_close``), then close the
        connector and the mailbox. Idempotent; safe after a failed construction."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        with self._lock:
            sent, self._sent = list(self._sent.items()), OrderedDict()
        try:
            if self._reaper is not None:
                self._reaper.close()
            if not self.keep_on_close and self._mailbox is not None and sent:
                for k, rid in sent:
                    self._mailbox.discard(k)
                    if rid and self._conn is not None:
                        self._conn.cleanup(rid)
        finally:
            if self._recycled is not None:
                self._recycled.close()
            if self._conn is not None:
                self._conn.close()
            if self._mailbox is not None:
                self._mailbox.close()
            if self._client is not None:
                self._client.close()

    def __enter__(self) -> KeyedHandoff:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> tuple[Mailbox, DiffusionConnector]:
        if self._closed or self._mailbox is None or self._conn is None:
            raise PayloadError("keyed handoff is closed")
        return self._mailbox, self._conn


def _has_handle(raw: bytes) -> bool:
    """Whether a record names bytes elsewhere (so its claim needs a lease); a record
    that does not decode gets one too (the consumer reports it)."""
    try:
        return bool(_decode_record(raw, "").handle)
    except HandleError:
        return True


def _raw(record: KeyedRecord) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(record))


def _decode_record(raw: bytes, key: str) -> KeyedRecord:
    try:
        env = _envelope_decoder.decode(raw)
        if env.magic != RECORD_MAGIC:
            raise HandleError(f"mailbox record {key!r} is foreign (magic {env.magic!r})")
        if env.version != RECORD_VERSION:
            raise HandleError(
                f"mailbox record {key!r} has format version {env.version}; this build reads "
                f"only version {RECORD_VERSION}"
            )
        return _record_decoder.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"mailbox record {key!r} is corrupt: {e}") from None


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if _is_torch(t) else int(t.nbytes)


def _destinations(
    handle: PayloadHandle, device: str, recycled: RecycledBuffers | None
) -> tuple[dict[str, Any], Callable[[], tuple[dict[int, Any], bytes]]]:
    """Fresh destinations for every tensor of ``handle``: torch-kind tensors share one
    torch buffer on ``device``, numpy-kind ones one numpy buffer, raw bytes get a
    bytearray each. Large host buffers come from ``recycled`` (registered, faulted in,
    reused only once the caller dropped every view of them). Returns (dst by name,
    finish) where finish() gives the tensors by index and the skeleton bytes once the
    payload has landed."""
    groups: dict[str, list[Any]] = {"torch": [], "numpy": []}
    dst: dict[str, Any] = {}
    raws: dict[str, bytearray] = {}
    for spec in handle.tensors:
        kind = "numpy" if spec.name == _SKELETON else spec.name.rpartition(".")[2]
        if kind == "bytes":
            raws[spec.name] = bytearray(spec.nbytes)
            dst[spec.name] = np.frombuffer(raws[spec.name], dtype=np.uint8)
        elif kind in groups:
            groups[kind].append(spec)
        else:
            raise HandleError(f"keyed payload has an unknown tensor {spec.name!r}")
    for kind, specs in groups.items():
        offsets, total = [], 0
        for spec in specs:
            offsets.append(total)
            total += -(-spec.nbytes // _ALIGN) * _ALIGN
        if not specs:
            continue
        if kind == "torch":
            import torch

            if recycled is not None and total >= _RECYCLE_MIN:
                buf = torch.from_numpy(recycled.take(total))
            else:
                buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        elif recycled is not None and total >= _RECYCLE_MIN:
            buf = recycled.take(total)
        else:
            buf = np.empty(max(total, 1), dtype=np.uint8)
        for spec, off in zip(specs, offsets, strict=True):
            dst[spec.name] = view_of(buf, off, spec)

    def finish() -> tuple[dict[int, Any], bytes]:
        moved: dict[int, Any] = {}
        for name, t in dst.items():
            if name == _SKELETON:
                continue
            index = int(name[1:].partition(".")[0])
            moved[index] = raws.get(name, t)
        skeleton = dst[_SKELETON].tobytes() if _SKELETON in dst else b""
        return moved, skeleton

    return dst, finish

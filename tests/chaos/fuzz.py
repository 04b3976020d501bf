"""Fuzz targets: every decoder of outside input, fed random and mutated bytes.

Each target is ``(strategy, check)``: ``check(x)`` feeds one input and fails (any
exception other than the target's typed error, or a changed state) when the
product misbehaves. ``run(name, n)`` runs ``n`` Hypothesis examples of a target
and returns how many ran; the test tier runs a few hundred per target,
``bench/chaos.py`` tens of thousands in all.

Targets: payload handles (``schema.decode_handle``), side-channel messages
(``schema.decode_message``), orchestrator wire frames (``wire.decode_from_worker`` /
``decode_from_service``), keyed mailbox records and their skeletons (what the
vLLM-Omni connector decodes: ``keyed._decode_record``, ``keyed.unpack``),
mailbox names, LightX2V's Phase 1 payload dicts (``payloads.unpack_phase1``,
``payloads.verify``) and the HTTP API's request bodies (its ASGI app, called in
process).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from asgicall import post
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_diffusion.errors import HandleError, PayloadError
from mooncake_diffusion.handoff.keyed import RECORD_VERSION, KeyedRecord, _decode_record, unpack
from mooncake_diffusion.orchestrator.link import wire
from mooncake_diffusion.wire.schema import (
    MAGIC,
    SCHEMA_VERSION,
    Envelope,
    PayloadHandle,
    StoreSource,
    TensorSpec,
    decode_handle,
    decode_message,
)

# ------------------------------------------------------------------ strategies
_scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
#: any JSON value, nested a little (drawing deep trees costs Hypothesis more than the
#: checks cost us, and the decoders reject a wrong type at the first level anyway)
_json = st.recursive(
    _scalar,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=6,
)
#: a value of the wrong type where a field expects one shape: flat, cheap to draw
_junk = _scalar | st.lists(_scalar, max_size=3)
_msgpackable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=10), c, max_size=5),
    max_leaves=30,
)


def _valid_handle() -> bytes:
    spec = TensorSpec("t0", "bfloat16", (2, 3, 4), (12, 4, 1), ((0, 48),))
    return PayloadHandle(
        payload_id="r/latent/0123456789abcdef",
        request_id="r",
        kind="latent",
        transport="store",
        lease="delete_on_consume",
        tensors=(spec,),
        source=StoreSource("mcd/r/latent/0123456789abcdef"),
        meta_json='{"fps": 16}',
        chunk_dim=1,
        num_chunks=3,
    ).encode()


def _mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """``seed`` with bytes flipped, cut, inserted or spliced: mostly almost valid."""

    def apply(ops: list[tuple[int, int, int]]) -> bytes:
        b = bytearray(seed)
        for kind, pos, val in ops:
            i = pos % (len(b) + 1)
            if kind == 0 and b:
                b[i % len(b)] ^= 1 << (val % 8)
            elif kind == 1:
                del b[i:]
            elif kind == 2:
                b[i:i] = bytes([val])
            elif b:
                b[i % len(b)] = val
        return bytes(b)

    op = st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255))
    return st.lists(op, min_size=1, max_size=4).map(apply)


def _enveloped(magic: str, version: int) -> st.SearchStrategy[bytes]:
    """Envelopes of the right magic and version around random msgpack bodies."""
    enc = msgspec.msgpack.Encoder()
    return _msgpackable.map(
        lambda body: enc.encode(Envelope(magic, version, msgspec.Raw(enc.encode(body))))
    )


def _bytes_for(seed: bytes, magic: str, version: int) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=300), _mutations(seed), _enveloped(magic, version))


# ------------------------------------------------------------------ checks
def check_handle(data: bytes) -> None:
    try:
        h = decode_handle(data)
    except HandleError:
        return
    # an accepted handle is whole: everything a consumer reads from it works
    assert isinstance(h.meta, dict)
    assert h.nbytes >= 0
    h.expired()
    assert decode_handle(h.encode()) == h


def check_message(data: bytes) -> None:
    try:
        decode_message(data)
    except HandleError:
        return


_WORK = wire.encode(
    wire.Work(
        wire.WorkItem("r", "denoise", 1, "standard", 0.0, b"{}", _valid_handle(), {"node": "a"})
    )
)
_DONE = wire.encode(wire.Done("w", wire.ItemRef("r", "denoise", 1), b"h", {"bytes": 3}))


def check_wire(data: bytes) -> None:
    for decode in (wire.decode_from_worker, wire.decode_from_service):
        try:
            msg = decode(data)
        except wire.WireError:
            continue
        assert (
            wire.decode_from_worker(wire.encode(msg)) == msg
            if decode is wire.decode_from_worker
            else True
        )


def _record(handle: bytes, skeleton: bytes) -> bytes:
    enc = msgspec.msgpack.Encoder()
    body = enc.encode(KeyedRecord(handle, skeleton, len(skeleton)))
    return enc.encode(Envelope("mcd-keyed", RECORD_VERSION, msgspec.Raw(body)))


_SKELETON = msgspec.msgpack.encode(
    {
        "x": msgspec.msgpack.Ext(
            1, msgspec.msgpack.encode(("torch", "float32", (2, 2), b"\0" * 16))
        ),
        "n": [1, 2.5, "a"],
        "s": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(("slice", {"start": 1, "stop": 4}))),
    }
)


def check_record(data: bytes) -> None:
    try:
        rec = _decode_record(data, "k")
    except HandleError:
        return
    assert isinstance(rec.handle, bytes) and isinstance(rec.skeleton, bytes)


def check_skeleton(data: bytes) -> None:
    try:
        unpack(data, {})
    except HandleError:
        return


def check_mailbox_name(name: str) -> None:
    from mooncake_diffusion.handoff.mailbox import Mailbox
    from mooncake_diffusion.handoff.protocol import Keys

    box = Mailbox.__new__(Mailbox)  # key_of needs no store
    box.namespace = "mcd-mbox/"
    box.keys = Keys(box.namespace)
    try:
        key = box.key_of(name)
    except PayloadError:
        return
    assert key == "mcd-mbox/" + name and 0 < len(name) <= 1024


_L2V_CONFIGS = st.sampled_from(
    [  # the operator's own configs (valid); meta and tensors are what comes off the wire
        {"task": "t2v", "enable_cfg": True, "model_cls": "wan2.1"},
        {"task": "i2v", "enable_cfg": False, "model_cls": "wan2.1", "vae_z_dim": 16},
        {"task": "i2i", "model_cls": "qwen_image", "enable_cfg": True, "target_video_length": 1},
        {"task": "s2v", "use_image_encoder": False},
        {},
    ]
)
_L2V_META = st.fixed_dictionaries(
    {},
    optional={
        "version": st.integers(-1, 3) | _junk,
        "task": st.sampled_from(["t2v", "i2v", "i2i"]) | _junk,
        "latent_shape": st.lists(st.integers(-2, 8), max_size=5) | _junk,
        "image_info": st.none() | st.dictionaries(st.text(max_size=5), _json, max_size=3) | _junk,
        "zeros": st.lists(st.sampled_from(["clip_encoder_out", "vae_encoder_out", "x"]), max_size=3)
        | _junk,
        "crc32": st.dictionaries(st.text(max_size=8), st.integers(0, 2**32)) | _junk,
    },
)
_L2V_TENSORS = st.dictionaries(
    st.sampled_from(["context", "context_null", "clip_encoder_out", "vae_encoder_out", "junk"]),
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(lambda s: torch.zeros(s)),
    max_size=4,
)


def check_lightx2v(case: tuple[dict, dict, dict]) -> None:
    from mooncake_diffusion_lightx2v import payloads

    config, tensors, meta = case
    before = {k: v.clone() for k, v in tensors.items()}
    try:
        if "crc32" in meta:
            payloads.verify(tensors, meta["crc32"])
        out = payloads.unpack_phase1(config, tensors, meta, torch.float32, "cpu")
    except PayloadError:
        out = None
    except ValueError as e:  # verify's checksum mismatch, as LightX2V raises it
        assert "Disagg:" in str(e), e
        out = None
    assert all(torch.equal(before[k], tensors[k]) for k in before)  # inputs untouched
    if out is not None:
        assert set(out) == {"text_encoder_output", "image_encoder_output", "latent_shape"}


# ------------------------------------------------------------------ HTTP bodies
class ApiTarget:
    """The HTTP API's app (``build_app``: its middleware, body limits, parsing and
    routes) in front of a started ``OrchestratorService`` with no workers, called
    in this process as an ASGI app, one request per case: no server, socket or
    thread between the body and the code that parses it. Refused bodies change
    nothing."""

    def __init__(self) -> None:
        from mooncake_diffusion.orchestrator.http.api import build_app
        from mooncake_diffusion.orchestrator.service.service import (
            OrchestratorService,
            ServiceConfig,
        )

        self.svc = OrchestratorService(ServiceConfig(worker_bind="tcp://127.0.0.1:0")).start()
        self.app = build_app(self.svc)
        self.loop = asyncio.new_event_loop()
        self.accepted = 0

    def close(self) -> None:
        self.loop.close()
        self.svc.close()

    async def _call(self, path: str, body: bytes, ctype: str) -> tuple[int, bytes]:
        """One POST through the app; (status, body)."""
        headers = {"host": "127.0.0.1", "content-type": ctype, "content-length": str(len(body))}
        status, _, out = await post(self.app, path, body, headers)
        return status, out

    def check(self, case: tuple[str, bytes, str]) -> None:
        path, body, ctype = case
        before = len(self.svc.table.live())
        status, raw = self.loop.run_until_complete(self._call(path, body, ctype))
        reply = json.loads(raw or b"{}")
        assert status < 500, (status, reply, body[:200])
        if status in (200, 201):
            self.accepted += 1
            return
        if 300 <= status < 400:  # a redirect (e.g. a trailing slash): nothing happened
            assert len(self.svc.table.live()) == before, "a redirected body changed state"
            return
        err = reply.get("error")  # OpenAI's shape
        assert 400 <= status < 500 and isinstance(err, dict) and err["message"], (status, reply)
        assert len(self.svc.table.live()) == before, "a refused body changed state"


_SUBMIT_VALUE = {
    "params": _json,
    "request_id": st.text(max_size=300) | _junk,
    "slo_class": st.sampled_from(["interactive", "batch", "standard"]) | _junk,
    "cached_embeddings": st.text(max_size=20) | _junk,
    "deadline_s": st.floats() | _junk,
}
_BODIES = st.one_of(
    st.binary(max_size=200),
    _json.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={**_SUBMIT_VALUE, "junk": _json}).map(
        lambda d: json.dumps(d, allow_nan=True).encode()
    ),
)
_API_CASES = st.tuples(
    st.sampled_from(["/v1/requests", "/v1/requests/x/cancel", "/v1/requests/", "/v1/nope"]),
    _BODIES,
    st.sampled_from(["application/json", "text/plain"]),
)

# ------------------------------------------------------------------ registry
TARGETS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], None]]] = {
    "handle": (_bytes_for(_valid_handle(), MAGIC, SCHEMA_VERSION), check_handle),
    "sidechannel": (_bytes_for(_valid_handle(), MAGIC, SCHEMA_VERSION), check_message),
    "wire": (
        st.one_of(_bytes_for(_WORK, wire.MAGIC, wire.WIRE_VERSION), _mutations(_DONE)),
        check_wire,
    ),
    "mailbox_record": (
        st.one_of(
            _mutations(_record(_valid_handle(), _SKELETON)),
            _enveloped("mcd-keyed", RECORD_VERSION),
            st.binary(max_size=200),
        ),
        check_record,
    ),
    "vllm_omni_skeleton": (
        st.one_of(_mutations(_SKELETON), st.binary(max_size=200)),
        check_skeleton,
    ),
    "mailbox_name": (st.text(max_size=1100), check_mailbox_name),
    "lightx2v_payload": (st.tuples(_L2V_CONFIGS, _L2V_TENSORS, _L2V_META), check_lightx2v),
}


def run(name: str, n: int, seed: int | None = 0, batch: int = 1) -> int:
    """Run about ``n`` cases of target ``name`` (``"http_api"`` too); how many ran.
    Raises what the failing case raised (Hypothesis shrinks it first).

    ``batch`` > 1: each Hypothesis example is a list of ``batch`` inputs, each checked
    (a case each). Same inputs, same checks, a fraction of the engine's per-example
    cost; a failing list shrinks to the failing input as usual."""
    api = None
    if name == "http_api":
        api = ApiTarget()
        strategy, check = _API_CASES, api.check
    else:
        strategy, check = TARGETS[name]
    ran = [0]

    def one(x: Any) -> None:
        ran[0] += 1
        check(x)

    body = one
    if batch > 1:
        strategy = st.lists(strategy, min_size=batch, max_size=batch)

        def body(xs: list[Any]) -> None:
            for x in xs:
                one(x)

    test = settings(
        max_examples=max(1, -(-n // batch)),
        database=None,
        deadline=None,
        derandomize=seed is not None,
        suppress_health_check=list(HealthCheck),
    )(given(strategy)(body))
    try:
        test()
    finally:
        if api is not None:
            api.close()
    return ran[0]


NAMES = [*TARGETS, "http_api"]

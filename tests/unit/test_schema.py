import msgspec
import pytest

from mooncake_diffusion.errors import HandleError
from mooncake_diffusion.wire.schema import (
    SCHEMA_VERSION,
    FetchReply,
    P2PSource,
    PayloadHandle,
    StoreSource,
    TensorSpec,
    decode_handle,
    decode_message,
    encode,
)

pytestmark = pytest.mark.unit


def spec(name="latent", dtype="bfloat16", shape=(1, 16, 21, 90, 160)):
    n = 1
    for d in shape:
        n *= d
    size = {"bfloat16": 2, "float32": 4, "int64": 8}[dtype] * n
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return TensorSpec(name, dtype, shape, tuple(reversed(strides)), ((0, size),) if size else ())


def handle(n=1, source=None, transport="store"):
    return PayloadHandle(
        payload_id="req-1/latent/0123456789abcdef",
        request_id="req-1",
        kind="latent",
        transport=transport,
        lease="delete_on_consume",
        tensors=tuple(spec(f"t{i}") for i in range(n)),
        source=source or StoreSource("mcd/req-1/latent/0123456789abcdef"),
        meta_json='{"fps":16}',
    )


def test_roundtrip_is_equal_and_meta_survives():
    h = handle(3)
    back = decode_handle(h.encode())
    assert back == h
    assert back.meta == {"fps": 16}
    assert back.nbytes == 3 * 16 * 21 * 90 * 160 * 2


def test_eight_tensor_handle_is_under_1kb_in_both_transports():
    store = handle(8)
    p2p = handle(8, P2PSource("10.0.0.12:16384", "10.0.0.12:40123"), "p2p")
    assert len(store.encode()) < 1024, len(store.encode())
    assert len(p2p.encode()) < 1024, len(p2p.encode())


def test_unknown_version_is_rejected_with_both_versions_named():
    body = msgspec.msgpack.encode(handle())
    data = msgspec.msgpack.encode(["mcd", SCHEMA_VERSION + 1, msgspec.Raw(body)])
    with pytest.raises(HandleError, match=f"version {SCHEMA_VERSION + 1}.*{SCHEMA_VERSION}"):
        decode_handle(data)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00garbage", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode(["xyz", 1, 0])],
)
def test_corrupt_or_foreign_bytes_raise_handle_error(data):
    with pytest.raises(HandleError):
        decode_handle(data)


def test_truncated_handle_raises_handle_error():
    data = handle(2).encode()
    with pytest.raises(HandleError):
        decode_handle(data[: len(data) // 2])


def _tamper(**changes):
    """Encode a handle with fields replaced, bypassing construction-time checks."""
    fields = {f: getattr(handle(), f) for f in PayloadHandle.__struct_fields__}
    fields.update(changes)
    raw = [fields[f] for f in PayloadHandle.__struct_fields__]
    return msgspec.msgpack.encode(["mcd", SCHEMA_VERSION, msgspec.Raw(msgspec.msgpack.encode(raw))])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tensors": [["x", "complex128", [2], [1], [[0, 32]]]]}, "unsupported dtype"),
        ({"tensors": [["x", "float32", [-1], [1], [[0, 4]]]]}, "negative dimension"),
        ({"tensors": [["x", "float32", [4], [1], [[0, 8]]]]}, "cover 8 bytes"),
        ({"tensors": [["x", "float32", [4], [1], [[0, 8], [4, 8]]]]}, "overlap"),
        ({"tensors": [["x", "float32", [1 << 40], [1], [[0, 1 << 42]]]]}, "too large"),
        ({"tensors": [["x", "float32", [4], [1, 1], [[0, 16]]]]}, "strides and shape"),
        ({"kind": "video"}, "kind"),
        ({"lease": "forever"}, "lease"),
        ({"transport": "p2p"}, "StoreSource"),
        ({"ttl_s": -1.0}, "ttl_s"),
    ],
)
def test_invalid_fields_are_rejected_with_a_reason(changes, message):
    with pytest.raises(HandleError, match=message):
        decode_handle(_tamper(**changes))


def test_duplicate_tensor_names_are_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        PayloadHandle(
            "p", "r", "latent", "store", "shared", (spec("a"), spec("a")), StoreSource("x")
        )


def test_side_channel_messages_roundtrip_and_handles_are_not_messages():
    reply = FetchReply("consumed", "already")
    assert decode_message(encode(reply)) == reply
    with pytest.raises(HandleError):
        decode_message(handle().encode())


def test_zero_size_tensor_has_no_byte_ranges():
    s = spec(shape=(0, 4), dtype="float32")
    assert s.nbytes == 0 and s.ranges == ()


@pytest.mark.parametrize("meta", [b'{"fps":1x}', b"[1,2,3,45]", b"[[[[[[[[[["])
def test_a_handle_whose_meta_is_not_a_json_object_is_refused(meta):
    """Found by fuzzing: such a handle decoded fine and its ``meta`` raised later, in
    whichever consumer read it first."""
    good = b'{"fps":16}'
    assert len(meta) == len(good)
    with pytest.raises(HandleError, match="meta_json"):
        decode_handle(handle().encode().replace(good, meta))

"""Cache key recipe and entry metadata: pure logic, no Mooncake.

The test vectors were computed outside Python (``printf '%s' TEXT | sha256sum``)
from the canonical text written here, so they pin the recipe, not this code.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from mooncake_diffusion.caches import CacheKeyError, canonical_json, cfg_key, embedding_key
from mooncake_diffusion.caches.entry import (
    META_BYTES,
    EntryMeta,
    decode_meta,
    encode_meta,
)
from mooncake_diffusion.caches.errors import CacheEntryError
from mooncake_diffusion.caches.keys import (
    cfg_namespace,
    dtype_name,
    embedding_namespace,
    is_embedding_key,
)
from mooncake_diffusion.errors import PayloadError
from mooncake_diffusion.wire.schema import TensorSpec

pytestmark = pytest.mark.unit

NEG_PARAMS = {"max_length": 512, "dtype": "bfloat16"}
NEG_KEY = (
    "mcd-cache/emb/v1/8d7622d53d198a3b/"
    "974d5abec0d465c2a9011e6806ee015d887e8320cd50d8f05a7b2b2223fa5fa1"
)


def test_import_loads_neither_mooncake_nor_torch():
    code = (
        "import sys, mooncake_diffusion.caches; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mooncake', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ test vectors
def test_embedding_key_vector():
    text = (
        '{"encoder":"t5-v1_1-xxl","params":{"dtype":"bfloat16","max_length":512},'
        '"prompt":"blurry, low quality","version":"1.0"}'
    )
    fields = {
        "encoder": "t5-v1_1-xxl",
        "version": "1.0",
        "prompt": "blurry, low quality",
        "params": NEG_PARAMS,
    }
    assert canonical_json(fields) == text
    assert embedding_key("t5-v1_1-xxl", "1.0", "blurry, low quality", NEG_PARAMS) == NEG_KEY
    assert embedding_namespace("t5-v1_1-xxl", "1.0") == "mcd-cache/emb/v1/8d7622d53d198a3b/"


def test_embedding_key_vector_with_numbers_escapes_and_unicode():
    params = {
        "whole": 2.0,
        "tiny": 1e-7,
        "nested": {"b": 1, "a": -0.0},
        "list": [1, True, None, "x"],
        "huge": 1e21,
        "guidance": 7.5,
    }
    prompt = 'a "café" ☕\n\ttab'
    text = (
        '{"encoder":"clip-l","params":{"guidance":7.5,"huge":1e+21,"list":[1,true,null,"x"],'
        '"nested":{"a":0,"b":1},"tiny":1e-7,"whole":2},"prompt":"a \\"café\\" ☕\\n\\ttab",'
        '"version":"2024.06"}'
    )
    fields = {"encoder": "clip-l", "version": "2024.06", "prompt": prompt, "params": params}
    assert canonical_json(fields) == text
    assert embedding_key("clip-l", "2024.06", prompt, params) == (
        "mcd-cache/emb/v1/1a4767183c3b7a7e/"
        "d441c58bd2a16cb43468e28eecdb60bb79125a6720a1cb831731f57a9db2a263"
    )


def test_cfg_key_vector():
    key = cfg_key("wan2.1-t2v-1.3b@main", NEG_KEY, 12, 812.5, (1, 16, 21, 60, 104), torch.bfloat16)
    assert key == (
        "mcd-cache/cfg/v1/4fdb4a14a5a98500/"
        "abd8286da6a46895f093dba382f00a5af2cd8aee1757506fec576cd2572ec96b"
    )
    assert key.startswith(cfg_namespace("wan2.1-t2v-1.3b@main"))


# ------------------------------------------------------------ canonicalization
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (7.5, "7.5"),
        (7.0, "7"),
        (7, "7"),
        (-0.0, "0"),
        (100.0, "100"),
        (1e20, "100000000000000000000"),
        (1e21, "1e+21"),
        (0.000001, "0.000001"),
        (1e-7, "1e-7"),
        (1.23456e-8, "1.23456e-8"),
        (-1.5e300, "-1.5e+300"),
        (5e-324, "5e-324"),
        (2.0**60, "1152921504606847000"),
        (0.1 + 0.2, "0.30000000000000004"),
        (2**53, "9007199254740992"),
        (-(2**53), "-9007199254740992"),
        (np.float64(0.5), "0.5"),
    ],
)
def test_numbers_are_written_as_ecmascript_writes_them(value, text):
    # the expected texts are what node's String(x) prints for the same doubles
    assert canonical_json(value) == text


def test_strings_escape_only_quotes_backslashes_and_control_characters():
    assert canonical_json('"\\\b\t\n\f\r\x00\x1f\x7f\u2028é😀') == (
        '"\\"\\\\\\b\\t\\n\\f\\r\\u0000\\u001f\x7f\u2028é😀"'
    )


def test_object_keys_sort_by_utf16_code_units():
    # U+1F600 is a surrogate pair (D83D DE00) and so sorts before U+E000 in UTF-16
    value = {"\ue000": 1, "😀": 2, "b": 3, "a": 4}
    assert canonical_json(value) == '{"a":4,"b":3,"😀":2,"\ue000":1}'


def test_param_order_does_not_matter_but_every_field_does():
    base = embedding_key("t5", "1", "a cat", {"a": 1, "b": [1, 2]})
    assert embedding_key("t5", "1", "a cat", {"b": [1, 2], "a": 1}) == base
    assert embedding_key("t5", "1", "a cat", {"b": (1, 2), "a": 1.0}) == base  # same JSON
    others = [
        embedding_key("t5", "1", "a dog", {"a": 1, "b": [1, 2]}),
        embedding_key("t5", "2", "a cat", {"a": 1, "b": [1, 2]}),
        embedding_key("t5b", "1", "a cat", {"a": 1, "b": [1, 2]}),
        embedding_key("t5", "1", "a cat", {"a": 2, "b": [1, 2]}),
        embedding_key("t5", "1", "a cat", {"a": 1, "b": [2, 1]}),
        embedding_key("t5", "1", "a cat", {"a": True, "b": [1, 2]}),  # true != 1
        embedding_key("t5", "1", "a cat ", {"a": 1, "b": [1, 2]}),
        embedding_key("t5", "1", "a cat", {"a": 1, "b": [1, 2], "c": None}),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert all(is_embedding_key(k) for k in [base, *others])


def test_no_params_is_the_empty_object():
    assert embedding_key("t5", "1", "p") == embedding_key("t5", "1", "p", {})


def test_version_changes_the_namespace_so_old_entries_can_be_found():
    k1, k2 = embedding_key("t5", "1", "p"), embedding_key("t5", "2", "p")
    assert k1.startswith(embedding_namespace("t5", "1"))
    assert not k2.startswith(embedding_namespace("t5", "1"))


def test_cfg_key_covers_every_field_and_accepts_dtype_spellings():
    args = ("wan", NEG_KEY, 3, 981.0, (1, 16, 8, 8), "float16")
    base = cfg_key(*args)
    assert cfg_key("wan", NEG_KEY, 3, 981, torch.Size([1, 16, 8, 8]), torch.float16) == base
    assert cfg_key("wan", NEG_KEY, 3, 981.0, [1, 16, 8, 8], np.dtype("float16")) == base
    variants = [
        ("wan2", NEG_KEY, 3, 981.0, (1, 16, 8, 8), "float16"),
        ("wan", embedding_key("t5", "1", "other"), 3, 981.0, (1, 16, 8, 8), "float16"),
        ("wan", NEG_KEY, 4, 981.0, (1, 16, 8, 8), "float16"),
        ("wan", NEG_KEY, 3, 981.5, (1, 16, 8, 8), "float16"),
        ("wan", NEG_KEY, 3, 981.0, (2, 16, 8, 8), "float16"),
        ("wan", NEG_KEY, 3, 981.0, (1, 16, 8, 8), "bfloat16"),
    ]
    assert len({base, *(cfg_key(*v) for v in variants)}) == 1 + len(variants)


# ------------------------------------------------------------------- bad input
def _nested(depth):
    v = [1]
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"g": math.nan}, r"params\['g'\].*finite"),
        ({"g": math.inf}, r"finite"),
        ({"g": [1, -math.inf]}, r"params\['g'\]\[1\]"),
        ({"seed": 2**53 + 1}, r"2\*\*53"),
        ({"b": b"raw"}, r"bytes is not a JSON value"),
        ({"s": {1, 2}}, r"set is not a JSON value"),
        ({"n": np.int64(3)}, r"\.item\(\)"),
        ({"t": torch.tensor(1.0)}, r"Tensor is not a JSON value"),
        ({1: "int key"}, r"not a string"),
        ({"p": "\ud800"}, r"surrogate"),
        ({"deep": _nested(40)}, r"deeper"),
    ],
)
def test_bad_params_are_rejected_naming_the_culprit(params, match):
    with pytest.raises(CacheKeyError, match=match):
        embedding_key("t5", "1", "p", params)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", "1", "p", {}), "encoder_id"),
        (("t5", "", "p", {}), "encoder_version"),
        (("t5", 1, "p", {}), "encoder_version"),
        (("t5", "1", b"p", {}), "prompt must be a string"),
        (("t5", "1", ["p"], {}), "prompt must be a string"),
        (("t5", "1", "p", [("a", 1)]), "params must be a dict"),
    ],
)
def test_bad_embedding_fields_are_rejected(args, match):
    with pytest.raises(CacheKeyError, match=match):
        embedding_key(*args)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"neg_key": "blurry, low quality"}, "not an embedding key"),
        ({"neg_key": NEG_KEY + "0"}, "not an embedding key"),
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"step": 2.0}, "step"),
        ({"timestep": torch.tensor(981.0)}, "timestep.*float"),
        ({"timestep": "981"}, "timestep"),
        ({"timestep": math.nan}, r"cfg key\['timestep'\].*finite"),
        ({"shape": (1, -16)}, "shape"),
        ({"shape": "1x16"}, "shape"),
        ({"dtype": "complex64"}, "unsupported dtype"),
        ({"model_id": ""}, "model_id"),
    ],
)
def test_bad_cfg_fields_are_rejected(change, match):
    args = {
        "model_id": "wan",
        "neg_key": NEG_KEY,
        "step": 0,
        "timestep": 981.0,
        "shape": (1, 16),
        "dtype": "float32",
    }
    with pytest.raises(CacheKeyError, match=match):
        cfg_key(**{**args, **change})


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(np.dtype("int64")) == "int64"
    with pytest.raises(CacheKeyError):
        dtype_name(torch.complex64)


# ---------------------------------------------------------------- entry metadata
def _spec(name="embeds", shape=(2, 3)):
    n = math.prod(shape) * 4
    return TensorSpec(name, "float32", shape, (shape[1], 1), ((0, n),) if n else ())


def _meta(**kw):
    fields = {
        "kind": "emb",
        "key": NEG_KEY,
        "owner": "t5",
        "version": "1",
        "tensors": (_spec(),),
        "data_bytes": 24,
        "created": 1.0,
    }
    return EntryMeta(**{**fields, **kw})


def test_metadata_is_fixed_size_and_round_trips():
    meta = _meta(tensors=(_spec(), _spec("mask", (2, 0))))
    blob = encode_meta(meta)
    assert len(blob) == META_BYTES
    assert decode_meta(blob, "k") == meta


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"\x00" * META_BYTES, "claims 0 bytes"),
        (b"\xff\xff\x00\x00" + b"\x00" * (META_BYTES - 4), "claims"),
        (b"\x03\x00\x00\x00abc" + b"\x00" * (META_BYTES - 7), "not a cache entry"),
        (b"\x01\x00", "truncated"),
    ],
)
def test_garbage_metadata_is_an_entry_error(blob, match):
    with pytest.raises(CacheEntryError, match=match):
        decode_meta(blob, "k")


def test_foreign_magic_and_unknown_version_are_entry_errors():
    import msgspec

    good = encode_meta(_meta())
    n = int.from_bytes(good[:4], "little")
    env = msgspec.msgpack.decode(good[4 : 4 + n])
    for magic, version, match in [("mcd", 1, "foreign"), ("mcd-cache", 2, "format version 2")]:
        raw = msgspec.msgpack.encode([magic, version, env[2]])
        blob = len(raw).to_bytes(4, "little") + raw
        with pytest.raises(CacheEntryError, match=match):
            decode_meta(blob + bytes(META_BYTES - len(blob)), "k")


def test_inconsistent_metadata_is_rejected_at_decode():
    import msgspec

    good = encode_meta(_meta())
    n = int.from_bytes(good[:4], "little")
    env = msgspec.msgpack.decode(good[4 : 4 + n])
    env[2][5] = 25  # data_bytes no longer the tensors' sum
    raw = msgspec.msgpack.encode(env)
    blob = len(raw).to_bytes(4, "little") + raw
    with pytest.raises(CacheEntryError, match="data_bytes"):
        decode_meta(blob + bytes(META_BYTES - len(blob)), "k")


def test_metadata_that_cannot_fit_is_refused_before_writing():
    # 64 tensors (the most an entry may have) with 128-character names: ~10 KiB
    specs = tuple(_spec(f"{i:03d}" + "n" * 125, (1, 1)) for i in range(64))
    assert len(specs[0].name) == 128
    with pytest.raises(PayloadError, match="fewer tensors or shorter names"):
        encode_meta(_meta(tensors=specs, data_bytes=4 * 64))
    encode_meta(_meta(tensors=specs[:32], data_bytes=4 * 32))  # half of that fits

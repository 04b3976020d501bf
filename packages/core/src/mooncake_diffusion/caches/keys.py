"""Cache keys: a stable, language-neutral recipe that any engine can compute.

Canonical form ``C(value)`` (RFC 8785, the JSON Canonicalization Scheme, on the
subset below), then UTF-8:

- ``null``, ``true``, ``false``; strings; numbers; arrays; objects whose keys are
  strings. Nothing else (bytes, sets, tensors, numpy scalars) is accepted.
- Objects: members sorted by key, keys compared as sequences of UTF-16 code
  units; no whitespace anywhere: ``{"a":1,"b":[true,null]}``.
- Strings: ``"`` + text + ``"``, escaping only ``"`` as ``\\"``, ``\\`` as ``\\\\``,
  U+0008/09/0A/0C/0D as ``\\b \\t \\n \\f \\r`` and every other code point below
  U+0020 as ``\\u00xx`` (lowercase hex). Everything else is written as itself
  (UTF-8 in the final bytes). Unpaired surrogates are rejected.
- Numbers: finite IEEE-754 doubles written as ECMAScript ``Number.prototype.toString``
  writes them (the shortest digits that read back to the same double):
  ``7.5``, ``7`` (for 7 and 7.0 alike), ``0.000001``, ``1e-7``, ``1e+21``, ``0`` for
  -0. Integers must lie within ±2**53 (exact in every language); NaN and
  ±Infinity are rejected. Booleans are not numbers (``true`` != ``1``).

Embedding key, recipe version 1 (``E`` encoder id, ``V`` encoder version, both
non-empty strings; ``T`` the prompt string; ``P`` the encoder params, an object,
``{}`` when there are none)::

    ns    = lowercase_hex(sha256(C({"encoder": E, "version": V})))[:16]
    entry = lowercase_hex(sha256(C({"encoder": E, "params": P, "prompt": T, "version": V})))
    key   = "mcd-cache/emb/v1/" + ns + "/" + entry

CFG-branch key, recipe version 1 (``M`` model id with its revision, ``N`` the
embedding key of the negative prompt, ``I`` the step index, an integer >= 0,
``τ`` the scheduler timestep, a number, ``S`` the shape, an array of integers
>= 0, ``D`` the dtype name, e.g. ``"bfloat16"``)::

    ns    = lowercase_hex(sha256(C({"model": M})))[:16]
    entry = lowercase_hex(sha256(C({"dtype": D, "model": M, "neg": N, "shape": S,
                                    "step": I, "timestep": τ})))
    key   = "mcd-cache/cfg/v1/" + ns + "/" + entry

The entry hash covers every field, so correctness never rests on the short
``ns``; ``ns`` groups the keys of one encoder version (or one model) so they can
be recognised from the key alone and removed with one prefix. An entry is two
Store objects, ``key + "/data"`` then ``key + "/meta"`` (see ``entry.py``).

Test vector (pinned in ``tests/unit/test_cache_keys.py``): encoder
``"t5-v1_1-xxl"``, version ``"1.0"``, prompt ``"blurry, low quality"``, params
``{"max_length": 512, "dtype": "bfloat16"}`` hash the UTF-8 bytes of
``{"encoder":"t5-v1_1-xxl","params":{"dtype":"bfloat16","max_length":512},"prompt":"blurry, low quality","version":"1.0"}``.
"""  # noqa: E501

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from mooncake_diffusion.caches.errors import CacheKeyError
from mooncake_diffusion.wire.schema import DTYPE_SIZES

__all__ = [
    "CFG_ROOT",
    "EMB_ROOT",
    "canonical_json",
    "cfg_key",
    "cfg_namespace",
    "dtype_name",
    "embedding_key",
    "embedding_namespace",
    "is_embedding_key",
]

#: Every key of the caches starts with ``mcd-cache/``; the version is the recipe's.
EMB_ROOT = "mcd-cache/emb/v1/"
CFG_ROOT = "mcd-cache/cfg/v1/"

MAX_INT = 2**53
MAX_DEPTH = 32
MAX_ID = 256

_EMB_KEY = re.compile(r"mcd-cache/emb/v1/[0-9a-f]{16}/[0-9a-f]{64}")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f"}
_ESCAPES["\r"] = "\\r"
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')


def _escape(m: re.Match[str]) -> str:
    ch = m[0]
    return _ESCAPES.get(ch) or f"\\u{ord(ch):04x}"


def _string(s: str, path: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise CacheKeyError(f"{path}: a string with an unpaired surrogate cannot hash") from None
    return '"' + _NEEDS_ESCAPE.sub(_escape, s) + '"'


def _float(x: float, path: str) -> str:
    if not math.isfinite(x):
        raise CacheKeyError(f"{path}: {x!r} is not allowed in a cache key (finite numbers only)")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    tup = Decimal(repr(abs(x))).as_tuple()  # repr: the shortest round-trip digits
    digits = "".join(map(str, tup.digits))
    exp = int(tup.exponent)
    stripped = digits.rstrip("0")
    exp += len(digits) - len(stripped)
    digits = stripped.lstrip("0")
    k = len(digits)
    n = exp + k  # value = 0.digits * 10**n, as in ECMAScript's Number::toString
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    e = n - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{sign}{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def _encode(v: Any, path: str, depth: int) -> str:
    if depth > MAX_DEPTH:
        raise CacheKeyError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, str):
        return _string(v, path)
    if isinstance(v, int):
        if not -MAX_INT <= v <= MAX_INT:
            raise CacheKeyError(
                f"{path}: integer {v} is beyond ±2**53, which not every language holds "
                "exactly; pass it as a string"
            )
        return str(int(v))
    if isinstance(v, float):
        return _float(float(v), path)
    if isinstance(v, Mapping):
        members = []
        for k in v:
            if not isinstance(k, str):
                raise CacheKeyError(f"{path}: object key {k!r} is not a string")
        for k in sorted(v, key=lambda s: s.encode("utf-16-be", "surrogatepass")):
            sub = f"{path}[{k!r}]"
            members.append(_string(k, sub) + ":" + _encode(v[k], sub, depth + 1))
        return "{" + ",".join(members) + "}"
    if isinstance(v, list | tuple):
        return "[" + ",".join(_encode(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)) + "]"
    hint = " (convert it with .item() or float())" if hasattr(v, "item") else ""
    raise CacheKeyError(
        f"{path}: a {type(v).__name__} is not a JSON value (null, bool, number, string, "
        f"list or dict){hint}"
    )


def canonical_json(value: Any, *, what: str = "value") -> str:
    """``C(value)`` of the module docstring, as text; raises ``CacheKeyError`` naming
    the offending part (``what`` prefixes the path, e.g. ``params['seed']``)."""
    return _encode(value, what, 0)


def _sha256(value: Any, what: str) -> str:
    return hashlib.sha256(canonical_json(value, what=what).encode("utf-8")).hexdigest()


def _ident(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID:
        raise CacheKeyError(f"{what} must be a non-empty string of at most {MAX_ID} characters")
    return value


def _params(params: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise CacheKeyError(f"params must be a dict of JSON values, got a {type(params).__name__}")
    canonical_json(params, what="params")  # the error names the offending param
    return params


def embedding_namespace(encoder_id: str, encoder_version: str) -> str:
    """The key prefix shared by every entry of one encoder id and version."""
    e = _ident(encoder_id, "encoder_id")
    v = _ident(encoder_version, "encoder_version")
    return EMB_ROOT + _sha256({"encoder": e, "version": v}, "embedding key")[:16] + "/"


def embedding_key(
    encoder_id: str, encoder_version: str, prompt: str, params: Mapping[str, Any] | None = None
) -> str:
    """The embedding-cache key of (encoder, version, prompt, params); pure, no I/O."""
    ns = embedding_namespace(encoder_id, encoder_version)
    if not isinstance(prompt, str):
        raise CacheKeyError(f"prompt must be a string, got a {type(prompt).__name__}")
    fields = {
        "encoder": encoder_id,
        "params": _params(params),
        "prompt": prompt,
        "version": encoder_version,
    }
    return ns + _sha256(fields, "embedding key")


def is_embedding_key(key: object) -> bool:
    """Whether ``key`` has the form of an embedding key (any encoder)."""
    return isinstance(key, str) and _EMB_KEY.fullmatch(key) is not None


def cfg_namespace(model_id: str) -> str:
    """The key prefix shared by every CFG-branch entry of one model."""
    return CFG_ROOT + _sha256({"model": _ident(model_id, "model_id")}, "cfg key")[:16] + "/"


def dtype_name(dtype: Any) -> str:
    """``"bfloat16"`` for ``"bfloat16"``, ``torch.bfloat16`` or ``numpy.dtype('float32')``-likes."""
    name = str(getattr(dtype, "name", dtype)).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise CacheKeyError(f"unsupported dtype {dtype!r}; one of {sorted(DTYPE_SIZES)}")
    return name


def cfg_key(
    model_id: str, neg_key: str, step: int, timestep: float, shape: Sequence[int], dtype: Any
) -> str:
    """The CFG-branch key; ``neg_key`` must be an embedding key. Pure, no I/O."""
    ns = cfg_namespace(model_id)
    if not is_embedding_key(neg_key):
        raise CacheKeyError(
            f"neg_key {neg_key!r} is not an embedding key (mcd-cache/emb/v1/<16 hex>/<64 hex>); "
            "pass EmbeddingCache.key(negative_prompt, params)"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CacheKeyError(f"step must be an integer >= 0, got {step!r}")
    if isinstance(timestep, bool) or not isinstance(timestep, int | float):
        raise CacheKeyError(
            f"timestep must be a Python int or float, got a {type(timestep).__name__} "
            "(convert a tensor with float(t))"
        )
    dims = tuple(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else None
    if dims is None or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise CacheKeyError(f"shape must be a sequence of integers >= 0, got {shape!r}")
    fields = {
        "dtype": dtype_name(dtype),
        "model": model_id,
        "neg": neg_key,
        "shape": list(dims),
        "step": step,
        "timestep": timestep,
    }
    return ns + _sha256(fields, "cfg key")

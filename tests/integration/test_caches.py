"""Embedding and CFG-branch caches against a real master and store host.

Every test ends with the store holding exactly the keys it held before and no
registration left in flight (fixture ``make_cache``); the autouse thread check
of ``conftest.py`` runs last.
"""

import time

import pytest
import torch

from helpers import make_tensor, same_bytes
from mooncake_diffusion import LocalCluster
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.caches import (
    CacheEntryError,
    CacheKeyError,
    CacheMismatchError,
    CfgCache,
    EmbeddingCache,
)
from mooncake_diffusion.caches.entry import META_BYTES, EntryStore, Owner
from mooncake_diffusion.caches.worker import EncoderProcess, fake_encode, tensor_digest
from mooncake_diffusion.errors import DestinationMismatchError, PayloadError, StoreFullError

pytestmark = pytest.mark.integration

SHAPE, DTYPE = [2, 77, 64], "bfloat16"


def stored(cluster):
    """The store's keys now (a list: ``cluster`` is no mapping)."""
    return cluster.keys()


def wait_for_keys(cluster, expected, timeout=5.0):
    deadline = time.monotonic() + timeout
    while sorted(cluster.keys()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(cluster.keys())


@pytest.fixture
def store_baseline(mooncake_cluster):
    """Fails the test unless the store ends with the keys it started with."""
    before = sorted(mooncake_cluster.keys())
    yield before
    assert wait_for_keys(mooncake_cluster, before) == before


@pytest.fixture
def make_cache(mooncake_cluster, store_baseline):
    """Caches on the session cluster; at teardown each open one must hold only its
    metadata scratch registration, then its entries are cleared and it is closed."""
    made = []

    def make(kind="emb", **kw):
        if kind == "emb":
            kw.setdefault("encoder_id", "test-encoder")
            kw.setdefault("encoder_version", "1")
            cache = EmbeddingCache(mooncake_cluster.settings, **kw)
        else:
            kw.setdefault("model_id", "test-dit@1")
            cache = CfgCache(mooncake_cluster.settings, **kw)
        made.append((cache, cache.client.regs.count))
        return cache

    yield make
    for cache, regs in made:
        if not cache.closed:
            assert cache.client.regs.temporary == 0, "registration left in flight"
            assert cache.client.regs.count == regs, "registration left behind"
            cache.clear()
            cache.close()


def encode(prompt, params=None, shape=SHAPE, dtype=DTYPE):
    return fake_encode(prompt, params or {}, shape, dtype)


class Counting:
    """A compute() that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self):
        self.calls += 1
        return self.fn()


# ------------------------------------------------------------- across processes
def test_second_encoder_process_hits_what_the_first_computed(mooncake_cluster, make_cache):
    req = {
        "op": "get_or_compute",
        "encoder": "t5-x",
        "version": "1",
        "prompt": "a red fox",
        "params": {"max_length": 77},
        "shape": SHAPE,
        "dtype": DTYPE,
    }
    with EncoderProcess(mooncake_cluster.settings) as first:
        r1 = first.request(**req)
        s1 = first.request(op="stats")
    with EncoderProcess(mooncake_cluster.settings) as second:
        r2 = second.request(**req)
        s2 = second.request(op="stats")
    expected = encode("a red fox", {"max_length": 77})
    assert r1["ok"] and r2["ok"], (r1, r2)
    assert (r1["hit"], r1["computed"]) == (False, 1)
    assert (r2["hit"], r2["computed"]) == (True, 0)
    assert r1["sha256"] == r2["sha256"] == tensor_digest(expected)
    assert s1["stats"] == {"hits": 0, "misses": 1, "puts": 1}
    assert s2["stats"] == {"hits": 1, "misses": 0, "puts": 0}
    assert (s1["temporary"], s2["temporary"]) == (0, 0)
    # and this process reads the same bytes, under the same key
    cache = make_cache(encoder_id="t5-x", encoder_version="1")
    assert cache.key("a red fox", {"max_length": 77}) == r1["key"] == r2["key"]
    got = cache.get("a red fox", {"max_length": 77})
    assert got is not None and same_bytes(got["tensor"], expected)


def test_repeated_negative_prompts_hit_across_two_encoders(mooncake_cluster, make_cache):
    negatives = ["blurry, low quality", "worst quality, watermark", "deformed hands"]
    replies = []
    with (
        EncoderProcess(mooncake_cluster.settings) as a,
        EncoderProcess(mooncake_cluster.settings) as b,
    ):
        for i in range(50):
            prompt = negatives[i % 3]
            worker = a if i % 2 == 0 else b
            r = worker.request(
                op="get_or_compute",
                encoder="t5-neg",
                version="1",
                prompt=prompt,
                params={},
                shape=[1, 77, 32],
                dtype="float16",
            )
            assert r["ok"], r
            replies.append((prompt, r))
    hits = sum(r["hit"] for _, r in replies)
    assert hits >= 47
    assert sum(r["computed"] for _, r in replies) == 50 - hits
    for prompt, r in replies:
        assert r["sha256"] == tensor_digest(encode(prompt, shape=[1, 77, 32], dtype="float16"))
    make_cache(encoder_id="t5-neg", encoder_version="1")  # clears the entries at teardown


# ---------------------------------------------------------------- in one process
def test_get_or_compute_returns_what_it_computed_then_hits(make_cache):
    cache = make_cache()
    tensors = {"embeds": encode("p"), "mask": torch.ones(2, 77, dtype=torch.bool)}
    compute = Counting(lambda: tensors)
    first, hit1 = cache.get_or_compute("p", {"n": 1}, compute)
    second, hit2 = cache.get_or_compute("p", {"n": 1}, compute)
    assert (hit1, hit2, compute.calls) == (False, True, 1)
    assert first is not second and set(second) == {"embeds", "mask"}
    assert all(same_bytes(second[k], tensors[k]) for k in tensors)
    assert second["embeds"].data_ptr() != tensors["embeds"].data_ptr()  # memory of its own
    s = cache.stats()
    nbytes = 2 * 77 * 64 * 2 + 2 * 77
    assert (s.hits, s.misses, s.puts, s.errors) == (1, 1, 1, 0)
    assert (s.bytes_read, s.bytes_written) == (nbytes, nbytes)
    assert s.hit_rate == 0.5


def test_entries_survive_their_writer_and_hold_two_objects(mooncake_cluster, make_cache):
    writer = make_cache()
    key = writer.put("p", None, encode("p"))
    writer.close()
    reader = make_cache()
    assert sorted(k for k in stored(mooncake_cluster) if k.startswith(key)) == [
        key + "/data",
        key + "/meta",
    ]
    got = reader.get_by_key(key)
    assert got is not None and same_bytes(got["tensor"], encode("p"))


def test_removed_entry_misses_and_is_recomputed(make_cache):
    cache = make_cache()
    compute = Counting(lambda: encode("p"))
    cache.get_or_compute("p", None, compute)
    cache.remove("p")
    assert cache.get("p") is None
    got, hit = cache.get_or_compute("p", None, compute)
    assert (hit, compute.calls) == (False, 2)
    assert same_bytes(got["tensor"], encode("p"))
    again = cache.get("p")
    assert again is not None and same_bytes(again["tensor"], encode("p"))


def test_metadata_without_data_is_a_miss_and_the_next_write_repairs_it(make_cache):
    cache = make_cache()
    key = cache.put("p", None, encode("p"))
    cache.client.remove_many([key + "/data"])  # as eviction may do: per object
    assert cache.get("p") is None
    compute = Counting(lambda: encode("p"))
    got, hit = cache.get_or_compute("p", None, compute)
    assert (hit, compute.calls) == (False, 1)
    again = cache.get("p")
    assert again is not None and same_bytes(again["tensor"], encode("p"))
    # a stale layout (the encoder now returns two tensors) is replaced, not misread
    cache.client.remove_many([key + "/data"])
    new = {"embeds": encode("p"), "pooled": encode("p", shape=[2, 64])}
    cache.get_or_compute("p", None, lambda: new)
    got = cache.get("p")
    assert got is not None and set(got) == {"embeds", "pooled"}
    assert same_bytes(got["pooled"], new["pooled"])


def test_first_writer_wins_and_a_second_put_is_harmless(make_cache):
    a, b = make_cache(), make_cache()
    a.put("p", None, encode("p"))
    b.put("p", None, encode("other"))  # same key, other bytes: a no-op, not an error
    got = b.get("p")
    assert got is not None and same_bytes(got["tensor"], encode("p"))


def test_into_caller_buffers_registered_once(make_cache):
    cache = make_cache()
    tensors = {"embeds": encode("p"), "pooled": encode("p", shape=[2, 64])}
    cache.put("p", None, tensors)
    bf16 = torch.bfloat16
    dst = {"embeds": torch.empty(SHAPE, dtype=bf16), "pooled": torch.empty(2, 64, dtype=bf16)}
    for t in dst.values():
        cache.register(t)
    got = cache.get("p", dst=dst)
    assert got is not None and all(got[k] is dst[k] for k in dst)
    assert all(same_bytes(dst[k], tensors[k]) for k in tensors)
    assert cache.client.regs.temporary == 0
    with pytest.raises(DestinationMismatchError):
        cache.get("p", dst={"embeds": torch.empty(2, 77, 63), "pooled": dst["pooled"]})
    with pytest.raises(PayloadError, match="dst names"):
        cache.get("p", dst={"embeds": dst["embeds"]})
    # a miss with dst: the computed result is copied there
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    got, hit = cache.get_or_compute("q", None, lambda: encode("q"), dst=out)
    assert not hit and got["tensor"] is out and same_bytes(out, encode("q"))
    for t in dst.values():
        cache.unregister(t)


def test_empty_tensors_need_no_data_object(mooncake_cluster, make_cache):
    cache = make_cache()
    key = cache.put("p", None, {"none": torch.empty(0, 8), "also": torch.empty(3, 0)})
    assert key + "/data" not in stored(mooncake_cluster)
    got = cache.get("p")
    assert got is not None and got["none"].shape == (0, 8) and got["also"].shape == (3, 0)


# ------------------------------------------------------------------- bad input
def test_mismatched_encoder_version_is_a_clear_error_and_writes_nothing(
    mooncake_cluster, make_cache
):
    v1 = make_cache(encoder_version="1")
    v2 = make_cache(encoder_version="2")
    key = v1.put("p", None, encode("p"))
    keys = sorted(mooncake_cluster.keys())
    assert v2.get("p") is None  # the version is in the key: v1's entry is never read
    with pytest.raises(CacheMismatchError, match="another encoder id or version"):
        v2.get_by_key(key)
    with pytest.raises(CacheKeyError, match="not an embedding-cache key"):
        v2.get_by_key("blurry, low quality")
    assert sorted(mooncake_cluster.keys()) == keys
    assert v2.stats().errors == 0  # the caller's input, not the store's fault


def test_entry_written_under_another_version_is_rejected_on_read(mooncake_cluster, make_cache):
    v2 = make_cache(encoder_version="2")
    # forge what a buggy engine might write: v1 metadata under v2's key
    forger = EntryStore(v2.client)
    meta, regions = forger.prepare(v2.key("p"), Owner("emb", "test-encoder", "1"), encode("p"))
    forger.write(meta, regions)
    forger.close()
    compute = Counting(lambda: encode("p"))
    with pytest.raises(CacheMismatchError, match=r"version '1'.*version '2'"):
        v2.get("p")
    with pytest.raises(CacheMismatchError):
        v2.get_or_compute("p", None, compute)
    assert compute.calls == 0
    assert v2.stats().errors == 2


def test_corrupt_metadata_is_an_entry_error(make_cache):
    cache = make_cache()
    key = cache.key("p")
    junk = torch.full((META_BYTES,), 0xAB, dtype=torch.uint8)
    cache.register(junk)
    cache.client.put_many([key + "/meta"], [[junk.data_ptr()]], [[META_BYTES]], pin="none")
    cache.unregister(junk)
    with pytest.raises(CacheEntryError, match="not a cache entry"):
        cache.get("p")


@pytest.mark.parametrize(
    ("params", "tensors", "error"),
    [
        ({"g": float("nan")}, lambda: encode("p"), CacheKeyError),
        ({"g": b"x"}, lambda: encode("p"), CacheKeyError),
        ({}, lambda: encode("p").transpose(0, 1), PayloadError),  # not contiguous
        ({}, lambda: {"a": encode("p"), "b": encode("p")[:, ::2]}, PayloadError),
        ({}, lambda: torch.zeros(4, dtype=torch.complex64), PayloadError),
        ({}, lambda: "not a tensor", PayloadError),
        ({}, lambda: {}, PayloadError),
        ({}, lambda: {f"{i:03d}" + "n" * 125: torch.zeros(1) for i in range(64)}, PayloadError),
    ],
    ids=["nan", "bytes", "strided", "one-bad-of-two", "dtype", "str", "empty", "meta-too-big"],
)
def test_bad_input_raises_before_anything_is_written(
    mooncake_cluster, make_cache, params, tensors, error
):
    cache = make_cache()
    keys = sorted(mooncake_cluster.keys())
    with pytest.raises(error):
        cache.put("p", params, tensors())
    with pytest.raises(error):
        cache.get_or_compute("p", params, tensors)
    assert sorted(mooncake_cluster.keys()) == keys
    assert cache.client.regs.temporary == 0
    assert cache.stats().puts == 0 and cache.stats().errors == 0


class MetadataPutFails(StoreClient):
    """A real client whose metadata puts fail as on a full pool (fault injection)."""

    def put_many(self, keys, ptrs, sizes, *, pin):
        if keys[0].endswith("/meta"):
            raise StoreFullError("injected: the pool filled up before the metadata put")
        super().put_many(keys, ptrs, sizes, pin=pin)


def test_failed_metadata_put_leaves_no_data_behind(mooncake_cluster, store_baseline):
    client = MetadataPutFails(mooncake_cluster.settings)
    try:
        with EmbeddingCache(
            mooncake_cluster.settings, encoder_id="e", encoder_version="1", client=client
        ) as cache:
            with pytest.raises(StoreFullError, match="injected"):
                cache.put("p", None, encode("p"))
            assert sorted(mooncake_cluster.keys()) == store_baseline  # the data went too
            got, hit = cache.get_or_compute("p", None, lambda: encode("p"))  # best effort
            assert not hit and same_bytes(got["tensor"], encode("p"))
            assert sorted(mooncake_cluster.keys()) == store_baseline
            s = cache.stats()
            assert (s.puts, s.errors) == (0, 2) and "injected" in s.last_error
            assert client.regs.temporary == 0
        assert client.regs.count == 0  # the cache dropped its scratch; the client stays open
    finally:
        client.close()


# -------------------------------------------------------------------- eviction
def test_evicted_entries_miss_and_are_recomputed_on_a_full_pool():
    """A 64 MiB pool and 8 MiB entries: Mooncake evicts the oldest soft-pinned
    objects in the background while puts meet a full pool; the cache never fails."""
    shape, dtype = [1024, 1024, 4], "float16"  # 8 MiB
    with (
        LocalCluster(pool_bytes=64 << 20) as cluster,
        EmbeddingCache(cluster.settings, encoder_id="big", encoder_version="1") as cache,
    ):
        first = cache.key("p0")
        cache.put("p0", None, encode("p0", None, shape, dtype))
        assert first + "/data" in stored(cluster)
        deadline = time.monotonic() + 60
        i = 1
        while first + "/data" in stored(cluster):  # keep the pool under pressure
            assert time.monotonic() < deadline, "nothing was evicted within 60 s"
            compute = Counting(lambda i=i: encode(f"p{i}", None, shape, dtype))
            _, hit = cache.get_or_compute(f"p{i}", None, compute)
            assert not hit and compute.calls == 1
            i += 1
            time.sleep(0.1)
        assert i >= 7  # about a poolful went in before anything was evicted
        compute = Counting(lambda: encode("p0", None, shape, dtype))
        got, hit = cache.get_or_compute("p0", None, compute)
        assert (hit, compute.calls) == (False, 1)
        assert same_bytes(got["tensor"], encode("p0", None, shape, dtype))
        s = cache.stats()
        assert s.misses == i and s.hits == 0
        assert s.puts + s.errors >= i + 1  # every entry was put or counted as refused
        assert cache.client.regs.temporary == 0
        cache.clear()


# ------------------------------------------------------------------------- CFG
_neg = "mcd-cache/emb/v1/" + "0" * 16 + "/" + "1" * 64  # any well-formed embedding key


def test_cfg_round_trip_and_exact_misses(make_cache):
    cfg = make_cache("cfg")
    x = make_tensor("bfloat16", (1, 16, 8, 8), seed=7)
    assert cfg.store(_neg, 3, 981.0, x)
    got = cfg.load(_neg, 3, 981.0, shape=x.shape, dtype=x.dtype)
    assert got is not None and same_bytes(got["tensor"], x)
    other = make_tensor("bfloat16", (1, 16, 8, 8), seed=8)
    assert cfg.store(_neg, 3, 981.0, other)  # already there: kept as it is
    got = cfg.load(_neg, 3, 981.0, shape=(1, 16, 8, 8), dtype="bfloat16")
    assert got is not None and same_bytes(got["tensor"], x)
    misses = [
        dict(step=4, timestep=981.0, shape=x.shape, dtype=x.dtype),
        dict(step=3, timestep=980.999, shape=x.shape, dtype=x.dtype),
        dict(step=3, timestep=981.0, shape=(2, 16, 8, 8), dtype=x.dtype),
        dict(step=3, timestep=981.0, shape=x.shape, dtype=torch.float16),
    ]
    for m in misses:
        assert cfg.load(_neg, m["step"], m["timestep"], shape=m["shape"], dtype=m["dtype"]) is None
    other_neg = _neg[:-1] + "2"
    assert cfg.load(other_neg, 3, 981.0, shape=x.shape, dtype=x.dtype) is None
    other_model = make_cache("cfg", model_id="test-dit@2")
    assert other_model.load(_neg, 3, 981.0, shape=x.shape, dtype=x.dtype) is None
    s = cfg.stats()
    assert (s.hits, s.misses, s.puts, s.errors) == (2, 5, 2, 0)
    assert s.bytes_read == 2 * x.numel() * 2


def test_cfg_load_into_dst_and_several_tensors(make_cache):
    cfg = make_cache("cfg")
    feats = {"uncond": make_tensor("float32", (1, 4, 8, 8), 1), "aux": torch.arange(5)}
    with pytest.raises(CacheKeyError, match="shape= and dtype="):
        cfg.store(_neg, 0, 999, feats)
    assert cfg.store(_neg, 0, 999, feats, shape=(1, 4, 8, 8), dtype="float32")
    dst = {"uncond": torch.empty(1, 4, 8, 8), "aux": torch.empty(5, dtype=torch.int64)}
    got = cfg.load(_neg, 0, 999.0, shape=[1, 4, 8, 8], dtype=torch.float32, dst=dst)
    assert got is not None and got["uncond"] is dst["uncond"]
    assert same_bytes(dst["uncond"], feats["uncond"]) and same_bytes(dst["aux"], feats["aux"])
    cfg.remove(_neg, 0, 999, shape=(1, 4, 8, 8), dtype="float32")
    assert cfg.load(_neg, 0, 999, shape=(1, 4, 8, 8), dtype="float32") is None


def test_cfg_bad_input_writes_nothing(mooncake_cluster, make_cache):
    cfg = make_cache("cfg")
    keys = sorted(mooncake_cluster.keys())
    x = torch.zeros(1, 4)
    with pytest.raises(CacheKeyError, match="not an embedding key"):
        cfg.store("blurry, low quality", 0, 999.0, x)
    with pytest.raises(CacheKeyError, match="timestep"):
        cfg.store(_neg, 0, torch.tensor(999.0), x)
    with pytest.raises(CacheKeyError, match="finite"):
        cfg.load(_neg, 0, float("nan"), shape=(1, 4), dtype="float32")
    with pytest.raises(PayloadError, match="contiguous"):
        cfg.store(_neg, 0, 999.0, torch.zeros(4, 2).t())
    assert sorted(mooncake_cluster.keys()) == keys


def test_clear_removes_only_its_own_namespace(mooncake_cluster, make_cache):
    a = make_cache(encoder_id="enc-a")
    b = make_cache(encoder_id="enc-b")
    cfg = make_cache("cfg")
    a.put("p", None, encode("p"))
    b.put("p", None, encode("p"))
    cfg.store(_neg, 0, 1.0, torch.zeros(4))
    assert a.clear() == 2
    assert a.get("p") is None
    assert b.get("p") is not None
    assert cfg.load(_neg, 0, 1.0, shape=(4,), dtype="float32") is not None

"""Raw Mooncake baselines in the benches retry transient codes within a deadline, as the
product does, and a row that still fails is reported as not measured (issue 33).
Pure logic: the Mooncake calls are scripted code sequences, time is a counter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import _common  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_transfer", ROOT / "bench" / "transfer.py")
transfer = importlib.util.module_from_spec(_spec)
sys.modules["bench_transfer"] = transfer  # its dataclasses look their module up
_spec.loader.exec_module(transfer)

LEASE_EXPIRED = -707


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def scripted(codes: list[int]):
    it = iter(codes)
    return lambda: next(it)


def test_a_transient_code_is_retried_and_counted():
    ft = FakeTime()
    retry = _common.TransientRetry(5.0, clock=ft.clock, sleep=ft.sleep)
    got = retry("batch_get_into", scripted([LEASE_EXPIRED, LEASE_EXPIRED, 1 << 28]))
    assert got == 1 << 28
    assert retry.retries == {"batch_get_into": 2}
    assert ft.t == pytest.approx(0.01 + 0.02)  # backoff doubles


def test_a_final_code_is_returned_at_once():
    retry = _common.TransientRetry(5.0, sleep=lambda s: pytest.fail("slept"))
    assert retry("put", scripted([-704])) == -704  # OBJECT_NOT_FOUND: not transient
    assert not retry.retries


def test_past_the_deadline_the_row_is_unmeasured_with_the_reason():
    ft = FakeTime()
    retry = _common.TransientRetry(1.0, clock=ft.clock, sleep=ft.sleep)
    with pytest.raises(_common.Unmeasured, match=r"batch_get_into .* -707 after \d+ retries"):
        retry("batch_get_into", lambda: LEASE_EXPIRED)
    assert ft.t <= 1.0 and retry.retries["batch_get_into"] >= 5


class FakePath(transfer.Path):
    def __init__(self, name: str, fail_on: int | None = None) -> None:
        self.name, self.fail_on, self.calls = name, fail_on, 0

    def verify(self, n: int) -> None:
        self.run(n)

    def run(self, n: int) -> float:
        self.calls += 1
        if self.calls == self.fail_on:
            raise _common.Unmeasured("batch_get_into still returned Mooncake code -707")
        return 0.5


def test_the_transfer_bench_reports_an_unmeasured_row_and_goes_on():
    ok, bad = FakePath("memcpy"), FakePath("raw_store", fail_on=3)
    unmeasured: dict[str, str] = {}
    medians = transfer.measure_size([ok, bad], 1 << 20, 1, 4, unmeasured)
    assert medians == {"memcpy": 0.5}
    assert "-707" in unmeasured["raw_store"] and bad.calls == 3  # not called again
    rows = transfer.rows_for(1 << 20, medians | {"connector_store": 0.25}, unmeasured)
    by = {r.path: r for r in rows}
    assert by["raw_store"].seconds is None and "-707" in by["raw_store"].unmeasured
    assert by["connector_store"].ratio is None  # no baseline, no ratio
    text = transfer.markdown(rows, {}, {"batch_get_into": 2})
    assert "not measured: 1 MiB raw_store" in text and "batch_get_into x2" in text
    assert transfer.summary(rows, _rt())["store_vs_raw_store"] is None


def _rt() -> dict[str, dict[str, float]]:
    q = {"p50_ms": 1.0, "p90_ms": 2.0}
    return {"p2p": q, "store": q, "same_host": q}


def test_the_vllm_omni_raw_store_retries_its_put_and_get():
    spec = importlib.util.spec_from_file_location(
        "bench_vllm_omni", ROOT / "bench" / "vllm_omni.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_vllm_omni"] = mod
    spec.loader.exec_module(mod)
    codes = iter([LEASE_EXPIRED, LEASE_EXPIRED, 0, LEASE_EXPIRED, 4096])

    class ScriptedStore:
        def put_from(self, key, ptr, nbytes, config):  # type: ignore[no-untyped-def]
            return next(codes)

        def get_into(self, key, ptr, nbytes):  # type: ignore[no-untyped-def]
            return next(codes)

    ft = FakeTime()
    raw = object.__new__(mod.RawStore)  # no Mooncake: the calls are scripted
    raw.store, raw.config = ScriptedStore(), None
    raw.retry = _common.TransientRetry(5.0, clock=ft.clock, sleep=ft.sleep)
    raw.put("k", 0, 4096)
    assert raw.get("k", 0, 4096) == 4096
    assert raw.retry.retries == {"put_from": 2, "get_into": 1}

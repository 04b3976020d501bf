"""Capacity at SLO, the fractional split and the arrival processes of the cluster
simulator. Virtual time only: every number below is simulated and deterministic for a
seed; no timing thresholds."""

import math
import random

import pytest

from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    QWEN_1024,
    RTX_4090,
    WAN_720P,
    Bursty,
    Diurnal,
    Layout,
    Poisson,
    Slo,
    Workload,
    attainment,
    capacity_at_slo,
    search_capacity,
    simulate,
    slo_base,
)

pytestmark = pytest.mark.unit

IMAGE = Workload("image", ((QWEN_1024, 0.5), (FLUX_1024, 0.5)))


def alone(kind):
    return Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)


def test_search_finds_the_threshold_and_reuses_probes():
    calls = []

    def probe(rate):
        calls.append(rate)
        # attainment falls linearly from 1 at rate 2 to 0 at rate 4; scale 2 is looser
        return {1.0: min(1.0, max(0.0, (4 - rate) / 2)), 2.0: min(1.0, max(0.0, (6 - rate) / 2))}

    caps, probes = search_capacity(probe, [Slo(1.0, 0.9), Slo(2.0, 0.9)], hi=5.0, rel_tol=0.01)
    assert caps[Slo(1.0, 0.9)] == pytest.approx(2.2, abs=0.01)
    assert caps[Slo(2.0, 0.9)] == pytest.approx(4.2, abs=0.01)
    assert len(calls) == len(set(calls)) == len(probes)  # no rate probed twice
    first = len(search_capacity(probe, [Slo(1.0, 0.9)], hi=5.0)[1])
    assert len(probes) < 2 * first  # the second SLO started from the first one's probes


def test_search_expands_when_the_first_bound_is_met():
    caps, _ = search_capacity(lambda r: {1.0: 1.0 if r < 30 else 0.0}, [Slo(1.0)], hi=5.0)
    assert 29 <= caps[Slo(1.0)] <= 30


def test_attainment_counts_window_arrivals_at_each_scale():
    base = slo_base([QWEN_1024, FLUX_1024], H100)
    r = simulate(IMAGE, Layout("colocated", 8), load=0.95, horizon=2000.0, seed=1)
    lo, hi = r.window
    tight, loose = attainment(r, base, 1.0), attainment(r, base, 3.0)
    assert 0.0 < tight < loose <= 1.0
    arrived = [x for x in r.records if lo <= x.submitted < hi]
    met = sum(x.done - x.submitted <= 3.0 * base[x.kind.name] for x in arrived)
    assert loose == met / len(arrived)


def test_slo_base_is_the_slower_single_request_latency():
    base = slo_base([QWEN_1024], H100)
    # disaggregated adds two 25 ms transfers to the same stage work; Qwen fits an H100
    assert base["qwen-1024"] == pytest.approx(QWEN_1024.isolated_s + 0.05)
    from mooncake_diffusion.simulate import QWEN_4090

    b = slo_base([QWEN_4090], RTX_4090)  # colocated offloads on a 24 GB card: slower
    assert b["qwen-4090"] > 2 * QWEN_4090.isolated_s


def test_capacity_grows_with_gpus_and_with_looser_slos():
    base = slo_base([QWEN_1024, FLUX_1024], H100)
    slos = (Slo(1.5, 0.9), Slo(1.5, 0.99), Slo(3.0, 0.9))
    kw = {"base": base, "slos": slos, "seed": 0, "arrivals_n": 300}
    small = capacity_at_slo(IMAGE, Layout("colocated", 4), **kw)
    big = capacity_at_slo(IMAGE, Layout("colocated", 16), **kw)
    for c in (small, big):
        assert c.rate[Slo(1.5, 0.99)] <= c.rate[Slo(1.5, 0.9)] <= c.rate[Slo(3.0, 0.9)]
        # below the isolated capacity: gpus / mean GPU-seconds per request
        assert c.rate[Slo(3.0, 0.9)] < 1.1 * c.gpus / IMAGE.mean_gpu_seconds()
    assert big.rate[Slo(1.5, 0.9)] > 3 * small.rate[Slo(1.5, 0.9)]  # pooling gains
    assert big.per_usd_hour(Slo(1.5, 0.9)) == pytest.approx(
        big.rate[Slo(1.5, 0.9)] * 3600 / (16 * H100.price_per_hour)
    )
    assert len(big.configs) == 1


def test_fractional_split_alone_is_at_parity_and_conserves_steps():
    lay = Layout("disaggregated", 4, aux=0, hosts=1)
    assert lay.split == "4:0 (E+V on 1 DiT GPU)"
    (rec,) = simulate(alone(QWEN_1024), lay, closed_loop=(1, 1)).records
    assert rec.done - rec.submitted == pytest.approx(QWEN_1024.isolated_s + 0.05)
    r = simulate(IMAGE, lay, load=0.8, horizon=600.0, seed=2)
    assert r.pool_gpus == {"denoise": 3, "host": 1}
    assert all(x.done is not None for x in r.records)
    # denoise jobs paused on the host for Encode/Decode resume: steps are not lost or redone
    assert r.steps_run == sum(x.kind.steps for x in r.records)
    # the host GPU also denoises: busy for far longer than all the Encode + Decode work
    assert r.busy["host"] > 2 * sum(x.kind.encode_s + x.kind.decode_s for x in r.records)


def test_fractional_host_pays_the_colocated_placement():
    w = alone(WAN_720P)
    lay = Layout("disaggregated", 2, aux=0, hosts=2)  # every GPU a host: decode on a host
    (rec,) = simulate(w, lay, closed_loop=(1, 1)).records
    tiled = WAN_720P.decode_s * WAN_720P.decode_tile_factor
    assert rec.done - rec.submitted == pytest.approx(
        WAN_720P.encode_s + WAN_720P.denoise_s + tiled + 0.05
    )
    with pytest.raises(ValueError, match="hosts"):
        simulate(w, Layout("disaggregated", 2, aux=0, hosts=3), closed_loop=(1, 1))


def test_a_model_without_a_measured_offload_time_is_reported_as_not_fitting():
    r = simulate(alone(QWEN_1024), Layout("colocated", 2, gpu=RTX_4090), closed_loop=(1, 1))
    assert r.cannot_fit == ["qwen-1024@colocated"]
    ok = simulate(alone(QWEN_1024), Layout("colocated", 2), closed_loop=(1, 1))
    assert ok.cannot_fit == []


def gap_stats(proc, rate, n=40_000):
    it = proc.gaps(random.Random(3), rate)
    xs = [next(it) for _ in range(n)]
    m = sum(xs) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) / m


@pytest.mark.parametrize("proc", [Poisson(), Bursty(), Diurnal()], ids=str)
def test_arrival_processes_keep_the_mean_rate(proc):
    mean, cv = gap_stats(proc, rate=2.0)
    assert mean == pytest.approx(0.5, rel=0.05)
    if isinstance(proc, Bursty):
        assert cv > 1.3  # bursty: gaps vary more than Poisson's
    elif isinstance(proc, Poisson):
        assert cv == pytest.approx(1.0, abs=0.05)


def test_burst_shape_is_the_same_at_every_rate():
    _, slow = gap_stats(Bursty(), rate=0.01)
    _, fast = gap_stats(Bursty(), rate=100.0)
    assert slow == pytest.approx(fast, rel=0.1)


def test_bursty_rates_and_validation():
    hi, lo = Bursty(peak=4.0, burst_share=0.15).rates(1.0)
    assert hi == 4.0 and 0.15 * hi + 0.85 * lo == pytest.approx(1.0)
    with pytest.raises(ValueError, match="peak"):
        Bursty(peak=8.0, burst_share=0.2).rates(1.0)


def test_simulate_takes_an_arrival_process_and_a_rate():
    a = simulate(IMAGE, Layout("colocated", 8), rate=0.5, horizon=400.0, seed=4)
    b = simulate(IMAGE, Layout("colocated", 8), rate=0.5, horizon=400.0, seed=4, arrivals=Bursty())
    assert len(a.records) != len(b.records)
    with pytest.raises(ValueError, match="rate"):
        simulate(IMAGE, Layout("colocated", 8), rate=0.0)

"""The simulator's flex and elastic layouts and its memory rule (issue 30, item 6).

Virtual time only: every number is simulated and deterministic for a seed; no timing
thresholds. ``memory="swap"`` charges model loads at ``LOAD_GBPS`` on every layout;
``flex`` is every GPU holding every stage; ``elastic`` is a static split that a
registry planner resizes during the run."""

import dataclasses

import pytest

from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    LOAD_GBPS,
    QWEN_1024,
    TRANSFER_S,
    WAN_720P,
    Layout,
    RequestKind,
    Workload,
    simulate,
)
from mooncake_diffusion.simulate.memory import ModelCache

pytestmark = pytest.mark.unit

IMAGE = Workload("image", ((QWEN_1024, 0.5), (FLUX_1024, 0.5)))
VIDEO = Workload("video", ((WAN_720P, 1.0),))


def alone(kind):
    return Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)


def latencies(r):
    return [x.done - x.submitted for x in sorted(r.records, key=lambda x: int(x.rid[1:]))]


# ---------------------------------------------------------------- flex = colocated
@pytest.mark.parametrize("kind", [QWEN_1024, FLUX_1024, WAN_720P], ids=lambda k: k.name)
def test_flex_matches_colocated_on_a_small_case(kind):
    """Every GPU holding every stage, on the same core and scheduler: each request stays
    on one GPU (Encode inline before Denoise, Decode on the GPU that made its latent),
    so a closed loop with one request per GPU runs as colocated, plus the one
    transfer the Decode item is charged; memory resident on both sides."""
    w = alone(kind)
    colo = simulate(w, Layout("colocated", 2), closed_loop=(2, 6), memory="resident")
    flex = simulate(w, Layout("flex", 2), closed_loop=(2, 6), memory="resident")
    assert flex.config == colo.config  # one scheduler
    assert len(flex.records) == len(colo.records) == 6
    for c, f in zip(latencies(colo), latencies(flex), strict=True):
        assert f == pytest.approx(c + TRANSFER_S, abs=1e-6)
    assert flex.pool_gpus == {"host": 2}


def test_flex_under_the_memory_rule_stays_close_to_colocated_on_one_kind():
    """One kind fits every GPU with all its stages: nothing loads on either side."""
    colo = simulate(VIDEO, Layout("colocated", 4), load=0.6, horizon=20_000.0, memory="swap")
    flex = simulate(VIDEO, Layout("flex", 4), load=0.6, horizon=20_000.0)
    assert colo.loaded_gb == flex.loaded_gb == 0.0
    assert flex.memory == "swap" and colo.memory == "swap"


# ---------------------------------------------------------------- memory is charged
def test_a_mix_that_does_not_fit_pays_its_model_loads():
    """Qwen-Image and FLUX together need 99.6 GB; an H100 offers 72 GB less the decode
    peak. On one GPU the swap run takes exactly the resident run plus every load at
    LOAD_GBPS (serial GPU, same arrivals): memory is not free."""
    res = simulate(IMAGE, Layout("colocated", 1), closed_loop=(1, 30), seed=3)
    swp = simulate(IMAGE, Layout("colocated", 1), closed_loop=(1, 30), seed=3, memory="swap")
    kinds = [x.kind.name for x in res.records]
    assert len(set(kinds)) == 2  # both kinds ran, so the GPU had to switch
    assert swp.loaded_gb > 0
    assert swp.makespan == pytest.approx(res.makespan + swp.loaded_gb / LOAD_GBPS, rel=1e-9)
    flex = simulate(IMAGE, Layout("flex", 1), closed_loop=(1, 30), seed=3)
    assert flex.loaded_gb > 0  # flex pays the same rule


def test_disaggregated_denoise_gpus_hold_both_image_dits_and_never_load():
    """The memory rule is per GPU: DiTs alone (64.7 GB) fit where all four models don't."""
    r = simulate(IMAGE, Layout("disaggregated", 4, aux=1), load=0.6, horizon=600.0, memory="swap")
    assert r.loaded_gb == 0.0
    c = simulate(IMAGE, Layout("colocated", 4), load=0.6, horizon=600.0, memory="swap")
    assert c.loaded_gb > 0


def test_single_kind_swap_is_the_resident_run():
    """What bench/sim.py relies on to reuse issue 29's runs for one-kind cells."""
    for lay in (Layout("colocated", 4), Layout("disaggregated", 4, aux=0, hosts=2)):
        a = simulate(VIDEO, lay, load=0.8, horizon=30_000.0, seed=5, memory="resident")
        b = simulate(VIDEO, lay, load=0.8, horizon=30_000.0, seed=5, memory="swap")
        assert latencies(a) == latencies(b) and b.loaded_gb == 0.0


def test_model_cache_evicts_least_recently_used_and_spares_pinned():
    c = ModelCache(10.0)
    assert c.need([(("dit", "a"), 6.0)]) == 6.0
    assert c.need([(("enc", "a"), 3.0)]) == 3.0
    assert c.need([(("dit", "a"), 6.0)]) == 0.0  # resident: now most recently used
    assert c.missing_gb([(("dit", "b"), 5.0)], pinned={("dit", "a")}) == float("inf")
    assert c.need([(("dit", "b"), 5.0)], pinned={("dit", "a")}) == 5.0
    assert ("enc", "a") not in c.resident  # unpinned went first
    assert ("dit", "a") not in c.resident  # then the pinned one: nothing else made room
    assert c.loaded_gb == 14.0 and c.loads == 3


# ---------------------------------------------------------------- elastic
FAST_DENOISE = RequestKind(
    "img-small", "interactive", encode_s=0.05, steps=10, step_s=0.2, decode_s=0.05,
    encoder_gb=5.0, dit_gb=10.0, vae_peak_gb=2.0, slo_s=60.0,
)  # fmt: skip
HEAVY_ENCODE = dataclasses.replace(
    FAST_DENOISE, name="long-prompt", encode_s=3.0, steps=2, encoder_gb=20.0
)
SHIFT = Workload("shift", ((FAST_DENOISE, 1.0),), later=((HEAVY_ENCODE, 1.0),), prompt_repeat=0.0)


def elastic_run(seed=0, planner="reactive"):
    lay = Layout("elastic", 4, aux=1, planner=planner)
    return simulate(SHIFT, lay, rate=0.9, horizon=1200.0, warmup=0.0, seed=seed)


def test_elastic_moves_a_gpu_to_the_stage_the_shifted_mix_starves():
    """Pools sized for a denoise-heavy mix; halfway the mix needs 3 s of Encode per
    request: the planner moves DiT GPUs to Encode after the shift, each move loads the
    encoder (20 GB at LOAD_GBPS), and nothing is lost or run twice."""
    r = elastic_run()
    assert r.planner is not None and r.planner["name"] == "reactive"
    moves = [(t, gpu, old, new) for t, gpu, old, new in r.stage_changes]
    assert moves, "the planner moved nothing"
    assert all(t >= 0.5 * 1200.0 for t, *_ in moves)  # only once the mix shifted
    assert ("denoise",) in [old for *_, old, _ in moves]
    assert ("encode",) in [new for *_, new in moves]
    assert r.planner["load_gpu_s"] == pytest.approx(
        sum(new == ("encode",) for *_, new in moves) * 20.0 / LOAD_GBPS
    )
    assert r.failed == 0 and r.rejected == 0
    assert all(x.done is not None for x in r.records)  # every request completed


def test_elastic_beats_its_static_split_under_the_shift():
    static = simulate(
        SHIFT, Layout("disaggregated", 4, aux=1), rate=0.9, horizon=1200.0, warmup=0.0,
        memory="swap",
    )  # fmt: skip
    el = elastic_run()
    late = [x for x in el.records if x.submitted >= 900.0]
    late_static = [x for x in static.records if x.submitted >= 900.0]
    mean = lambda xs: sum(x.done - x.submitted for x in xs) / len(xs)  # noqa: E731
    assert mean(late) < mean(late_static)


def test_elastic_is_deterministic_per_seed_and_names_its_planner():
    a, b = elastic_run(seed=7), elastic_run(seed=7)
    assert latencies(a) == latencies(b) and a.stage_changes == b.stage_changes
    p = elastic_run(seed=7, planner="predictive")
    assert p.planner is not None and p.planner["name"] == "predictive"


def test_elastic_layout_validation():
    with pytest.raises(ValueError, match="planner"):
        Layout("elastic", 4, aux=1)
    with pytest.raises(ValueError, match="aux_gpu"):
        Layout("flex", 4, aux_gpu=H100)
    assert Layout("elastic", 8, aux=1, planner="reactive").split == "7:1 elastic (reactive)"
    assert Layout("flex", 8).split == "8 flex"

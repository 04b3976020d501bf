"""The cluster simulator over the real orchestrator core: one scheduler for both layouts,
calibration against cited measurements, conservation, determinism and the mechanisms'
switches. Virtual time only (no timing thresholds: every number below is simulated,
deterministic for a seed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig
from mooncake_diffusion.simulate import (
    FLUX_1024,
    H100,
    L40S,
    QWEN_1024,
    QWEN_4090,
    QWEN_4090_50,
    RTX_4090,
    WAN_720P,
    Layout,
    Mechanisms,
    Scheduler,
    Workload,
    default_aux,
    placement_penalty,
    simulate,
    summarize,
)

pytestmark = pytest.mark.unit

VERDICTS = ("win", "tie", "lose")

MIXED = Workload("mixed", ((QWEN_1024, 0.45), (FLUX_1024, 0.45), (WAN_720P, 0.10)))
ROOT = Path(__file__).resolve().parents[2]


def alone(kind):
    return Workload(kind.name, ((kind, 1.0),), prompt_repeat=0.0, cache_negative=False)


def test_both_layouts_run_one_scheduler_config():
    """Everything but the layout is equal: the core's config, with the shipped bound."""
    colo = simulate(MIXED, Layout("colocated", 8), load=0.8, horizon=3000.0, seed=1)
    dis = simulate(MIXED, Layout("disaggregated", 8, aux=1), load=0.8, horizon=3000.0, seed=1)
    assert colo.config == dis.config == Scheduler().config()
    assert colo.config.max_preemptions == OrchestratorConfig().max_preemptions
    assert colo.config.preemption
    # the colocated side really uses it: batch jobs yield at step boundaries there too
    assert any(r.preemptions for r in colo.records)
    assert all(r.preemptions <= colo.config.max_preemptions for r in colo.records)
    changed = Scheduler(max_preemptions=5)
    a = simulate(MIXED, Layout("colocated", 8), sched=changed, load=0.5, horizon=500.0)
    b = simulate(MIXED, Layout("disaggregated", 8), sched=changed, load=0.5, horizon=500.0)
    assert a.config == b.config and a.config.max_preemptions == 5
    assert changed.changed() == {"preemption": True, "max_preemptions": 5}


@pytest.mark.parametrize("kind", [WAN_720P, QWEN_1024, FLUX_1024], ids=lambda k: k.name)
def test_one_request_alone_is_at_parity(kind):
    """docs/sources.md: a split pipeline matches colocated single-request latency."""
    lat = {}
    for lay in (Layout("colocated", 8), Layout("disaggregated", 8, aux=1)):
        (rec,) = simulate(alone(kind), lay, closed_loop=(1, 1)).records
        lat[lay.mode] = rec.done - rec.submitted
    assert lat["colocated"] >= kind.isolated_s  # + tiled decode where it does not fit
    # disaggregated: the same stage work plus two 25 ms transfers, nothing else
    assert lat["disaggregated"] == pytest.approx(kind.isolated_s + 0.05)
    assert 0.99 <= lat["disaggregated"] / lat["colocated"] <= 1.01


@pytest.mark.parametrize(
    ("kind", "lo", "hi"),
    [
        (QWEN_1024, 12.77, 13.10),  # SGLang CI, 1 x H100, 50 steps (docs/sources.md, M)
        (FLUX_1024, 4.30, 6.71),  # xDiT, 1 x H100, 28 steps, compiled / eager (docs/sources.md, M)
        (
            WAN_720P,
            1041.5 * 0.99,
            1041.5 * 1.01,
        ),  # Wan2.2-A14B, 1 x H100 (docs/sources.md, D from M)
    ],
    ids=lambda x: getattr(x, "name", None),
)
def test_single_request_latency_matches_the_measurement(kind, lo, hi):
    (rec,) = simulate(alone(kind), Layout("colocated", 1), closed_loop=(1, 1)).records
    assert lo <= rec.done - rec.submitted <= hi


def test_stage_shares_match_the_measurement():
    """LightX2V on H100, Qwen-Image, 50 steps: E 1.0 %, D 96.2 %, V 1.2 % (docs/sources.md, M)."""
    k = QWEN_1024
    shares = (k.encode_s / k.isolated_s, k.denoise_s / k.isolated_s, k.decode_s / k.isolated_s)
    for got, want in zip(shares, (0.010, 0.962, 0.012), strict=True):
        assert abs(got - want) <= 0.01


def lightx2v_qps(kind, lay, mech, conc):
    r = simulate(alone(kind), lay, mech, closed_loop=(conc, 100))
    assert len(r.records) == 100 and all(x.done for x in r.records)
    return 100 / r.makespan


def test_lightx2v_baseline_calibrates_the_step_count():
    """The measured 8:0 baseline (0.18 QPS, docs/sources.md, M) is what 8 steps give, not 50."""
    base8 = lightx2v_qps(QWEN_4090, Layout("colocated", 8, gpu=RTX_4090), Mechanisms.none(), 8)
    base50 = lightx2v_qps(QWEN_4090_50, Layout("colocated", 8, gpu=RTX_4090), Mechanisms.none(), 8)
    assert 0.18 / 1.25 <= base8 <= 0.18 * 1.25
    assert base50 < 0.18 / 3


def test_lightx2v_gain_comes_from_memory():
    lay = Layout("disaggregated", 8, aux=1, gpu=RTX_4090)
    base = lightx2v_qps(QWEN_4090, Layout("colocated", 8, gpu=RTX_4090), Mechanisms.none(), 8)
    split = lightx2v_qps(QWEN_4090, lay, Mechanisms(), 7)
    still = lightx2v_qps(QWEN_4090, lay, Mechanisms().without("fit_memory"), 7)
    assert split > base > still  # without the memory it frees, the split alone loses


# LightX2V blog (docs/sources.md): Qwen-Image-2512 T2I, 100 requests, RTX 4090s.
# (DiT GPUs, Encode GPUs, measured QPS, the same-size colocated baseline's QPS).
LIGHTX2V_OTHER_SPLITS = {
    "4:4": (4, 4, 0.20, 0.18),
    "5:3": (5, 3, 0.25, 0.18),
    "6:2": (6, 2, 0.30, 0.18),
    "7:1": (7, 1, 0.34, 0.18),
    "2:2 (4 GPUs, centralized)": (2, 2, 0.096, 0.092),
    "3:1 (4 GPUs, centralized)": (3, 1, 0.15, 0.092),
}
#: Stated tolerance, not fitted: the simulated gain over the same-size colocated run is
#: within 15 % of the measured gain. Absolute QPS: the simulator models no serving
#: overhead (HTTP, queues, Python), so it may only overestimate, by at most 35 %.
RATIO_TOLERANCE = 0.15
QPS_ABOVE_AT_MOST = 1.35


@pytest.mark.parametrize("split", list(LIGHTX2V_OTHER_SPLITS))
def test_lightx2v_other_splits_out_of_sample(split):
    """Only 8:0 at 8 steps set anything (the step count); every other split is a check."""
    dits, enc, measured, measured_base = LIGHTX2V_OTHER_SPLITS[split]
    n = dits + enc
    base = lightx2v_qps(QWEN_4090, Layout("colocated", n, gpu=RTX_4090), Mechanisms.none(), n)
    lay = Layout("disaggregated", n, aux=enc, gpu=RTX_4090)
    qps = lightx2v_qps(QWEN_4090, lay, Mechanisms(), dits)
    assert qps / base == pytest.approx(measured / measured_base, rel=RATIO_TOLERANCE)
    assert measured <= qps <= measured * QPS_ABOVE_AT_MOST


def test_lightx2v_centralized_7_1_is_outside_the_model():
    """The blog's centralized three-stage queue measured 0.24 QPS at 7:1 (1.33x): the
    simulator has no model of that queue's overhead and lands at the decentralized
    figure. This pins the documented miss (docs/evaluation.md, Calibration)."""
    base = lightx2v_qps(QWEN_4090, Layout("colocated", 8, gpu=RTX_4090), Mechanisms.none(), 8)
    lay = Layout("disaggregated", 8, aux=1, gpu=RTX_4090)
    ratio = lightx2v_qps(QWEN_4090, lay, Mechanisms(), 7) / base
    assert ratio > (0.24 / 0.18) * (1 + RATIO_TOLERANCE)
    assert ratio == pytest.approx(0.34 / 0.18, rel=RATIO_TOLERANCE)


def test_no_memory_limit_on_either_side_the_split_loses():
    """With no memory limit anywhere (no offload on either side), 7:1 gives up one of
    eight DiT GPUs for stages worth a few percent of the work."""
    from dataclasses import replace

    big = replace(RTX_4090, name="unbounded", memory_gb=1e9)
    base = lightx2v_qps(QWEN_4090, Layout("colocated", 8, gpu=big), Mechanisms.none(), 8)
    split = lightx2v_qps(QWEN_4090, Layout("disaggregated", 8, aux=1, gpu=big), Mechanisms(), 7)
    assert split / base < 7 / 8 + 0.01


def test_placement_follows_memory():
    """What an engine does when the stages do not fit (costs.placement_penalty)."""
    assert placement_penalty(QWEN_1024, H100, True, True, True).offload is False
    wan = placement_penalty(WAN_720P, H100, True, True, True)
    assert wan.tile and not wan.offload  # 79.2 GB does not fit in 72, tiled it does
    assert not placement_penalty(WAN_720P, H100, False, True, False).tile
    assert placement_penalty(QWEN_4090, RTX_4090, True, True, True).offload
    assert placement_penalty(QWEN_4090, RTX_4090, False, True, False).offload is False


def test_cheaper_aux_pool_costs_less_and_runs_slower():
    cheap = Layout("disaggregated", 8, aux=1, aux_gpu=L40S)
    same = Layout("disaggregated", 8, aux=1)
    assert cheap.price_per_hour() < same.price_per_hour() == Layout("colocated", 8).price_per_hour()
    w = alone(QWEN_1024)
    (a,) = simulate(w, cheap, closed_loop=(1, 1)).records
    (b,) = simulate(w, same, closed_loop=(1, 1)).records
    slow = L40S.slowdown_vs(H100)
    extra = (QWEN_1024.encode_s + QWEN_1024.decode_s) * (slow - 1)
    assert (a.done - a.submitted) - (b.done - b.submitted) == pytest.approx(extra)


def test_every_request_completes_once_and_preempted_jobs_resume():
    for lay in (Layout("disaggregated", 8, aux=1), Layout("colocated", 8)):
        r = simulate(MIXED, lay, load=0.8, horizon=8000.0, seed=3)
        assert r.failed == 0 and r.rejected == 0
        assert all(x.done is not None and x.ttff is not None for x in r.records)
        assert all(x.submitted < x.ttff <= x.done for x in r.records)
        preempted = [x for x in r.records if x.preemptions]
        assert preempted and all(x.kind.slo_class == "batch" for x in preempted)
        # resumed from their progress: the steps executed are exactly the steps requested
        assert r.steps_run == sum(x.kind.steps for x in r.records)


def test_same_seed_same_run():
    lay = Layout("disaggregated", 64, aux=default_aux(MIXED, 64))
    a = summarize(simulate(MIXED, lay, load=0.9, horizon=3000.0, seed=5))
    b = summarize(simulate(MIXED, lay, load=0.9, horizon=3000.0, seed=5))
    c = summarize(simulate(MIXED, lay, load=0.9, horizon=3000.0, seed=6))
    assert a == b and a != c


def test_priorities_and_preemption_protect_interactive_ttff_on_both_sides():
    for lay in (Layout("disaggregated", 8, aux=1), Layout("colocated", 8)):
        kw = {"load": 0.8, "horizon": 20000.0, "seed": 1}
        on = summarize(simulate(MIXED, lay, **kw))
        off = summarize(simulate(MIXED, lay, sched=Scheduler(priorities=False), **kw))
        assert on.preemptions > 0 and off.preemptions == 0
        assert on.p99_ttff < off.p99_ttff


def test_cross_instance_cache_skips_more_encodes():
    for lay in (Layout("disaggregated", 8, aux=2), Layout("colocated", 8)):
        kw = {"load": 0.5, "horizon": 4000.0, "seed": 2}
        on = summarize(simulate(MIXED, lay, Mechanisms(), **kw))
        off = summarize(simulate(MIXED, lay, Mechanisms().without("cross_instance_cache"), **kw))
        assert on.encodes_skipped > off.encodes_skipped
        assert on.requests == off.requests  # the same arrivals either way


def test_shifting_mix_changes_kinds_halfway():
    w = Workload("s", ((QWEN_1024, 1.0),), later=((FLUX_1024, 1.0),))
    r = simulate(w, Layout("colocated", 8), load=0.5, horizon=1000.0, seed=0)
    early = {x.kind.name for x in r.records if x.submitted < 500.0}
    late = {x.kind.name for x in r.records if x.submitted >= 500.0}
    assert early == {"qwen-1024"} and late == {"flux-1024"}


def test_layout_validation():
    with pytest.raises(ValueError, match="aux"):
        simulate(MIXED, Layout("disaggregated", 8, aux=8), load=0.5, horizon=100.0)
    with pytest.raises(ValueError, match="load"):
        simulate(MIXED, Layout("colocated", 8))


def test_bench_smoke_writes_the_summary(tmp_path):
    out = tmp_path / "sim.json"
    cells = ["image-8xh100", "qwen-4090-8xrtx4090"]
    args = ["--seeds", "2", "--arrivals", "60", "--cells", *cells, "--json", str(out)]
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sim.py"), *args],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    doc = json.loads(out.read_text())
    assert doc["bench"] == "sim"
    s = doc["summary"]
    assert s["same_scheduler"] is True
    assert s["smoke_run"] is True and s["verdicts_from_full"] is True
    assert s["seeds"]["judging"] == 2 and s["seeds"]["arrivals_per_probe"] == 60
    assert s["slo_attainment_target"] == 0.9
    assert (
        set(s["capacity_ratio"]) == set(s["best_split"]) == set(s["p99_ttff_ratio"]) == set(cells)
    )
    for c in cells:
        assert isinstance(s["capacity_ratio"][c]["per_gpu"], float)
        assert isinstance(s["capacity_ratio"][c]["per_cost"], float)
    assert sum(s["smoke_verdicts"].values()) == len(cells)
    # a smoke run's verdicts are the committed full run's, never its own
    full = json.loads((ROOT / "docs" / "results" / "sim.json").read_text())["summary"]
    assert s["verdicts"] == full["verdicts"] and s["verdict"] == full["verdict"]
    assert s["verdict_sentence"].startswith("Smoke run, not verdicts")
    lx = next(r for r in doc["rows"] if r.get("cell") == "qwen-4090-8xrtx4090")
    assert s["lightx2v_setting_capacity_ratio"] == lx["capacity_ratio"]["1.5x@90%"]
    for key in ("no_memory_limit_ratio", "lightx2v_setting_qps_ratio"):
        assert isinstance(s[key], float)
    assert s["no_memory_limit_ratio"] < 1 < s["lightx2v_setting_qps_ratio"]
    # issue 30: flex and elastic under the memory rule, beside colocated and the best split
    assert s["smoke_flex_verdicts"].keys() == s["smoke_elastic_verdicts"].keys()
    assert sum(s["smoke_flex_verdicts"].values()) == sum(s["smoke_elastic_verdicts"].values())
    assert sum(s["smoke_elastic_verdicts"].values()) == len(cells)
    assert set(s["flex_ratio"]) == set(s["elastic_ratio"]) == set(cells)
    assert set(cells) <= set(s["elastic_vs_best_static"])
    for c in cells:
        e = s["elastic_vs_best_static"][c]
        assert isinstance(e["ratio"], float) and "ci95" in e and e["verdict"] in VERDICTS
    assert s["planner"] == "reactive" and s["load_gbps"] > 0 and "swap" in s["memory_rule"]
    if full.get("flex_verdicts") is not None:
        assert s["flex_verdicts"] == full["flex_verdicts"]
        assert s["elastic_verdicts"] == full["elastic_verdicts"]

"""bench/e2e.py's colocated side serves under the disaggregated side's scheduler
configuration: class priorities, then arrival order; yields only to a higher class,
at most ``max_preemptions`` times. Pure logic (no model, no processes)."""

import importlib.util
from pathlib import Path

import msgspec
import pytest

from mooncake_diffusion.demo import demo_batch, orchestrator_config

pytestmark = pytest.mark.unit

_spec = importlib.util.spec_from_file_location(
    "bench_e2e", Path(__file__).resolve().parents[2] / "bench" / "e2e.py"
)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_interactive_first_then_arrival_order():
    batch = demo_batch(3, 2, 2)  # videos first in the batch, as the demo submits them
    q = e2e.ColocatedQueue(batch, orchestrator_config())
    order = [batch[q.pop()][0] for _ in range(len(batch))]
    assert order == ["img-0", "img-1", "img-2", "vid-0", "vid-1"]


def test_yields_only_to_a_higher_class_and_only_max_preemptions_times():
    batch = demo_batch(1, 2, 2)  # vid-0, vid-1, img-0
    cfg = orchestrator_config()
    q = e2e.ColocatedQueue(batch, cfg)
    q.waiting = [1]  # only another video waits: no yield
    assert not q.should_yield(0)
    q.waiting = [2]  # an image waits: the video yields, up to the bound
    assert q.should_yield(0)
    q.preemptions[0] = cfg.max_preemptions
    assert not q.should_yield(0)
    off = e2e.ColocatedQueue(batch, msgspec.structs.replace(cfg, preemption=False))
    off.waiting = [2]
    assert not off.should_yield(0)

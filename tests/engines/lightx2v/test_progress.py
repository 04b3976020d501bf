"""Queue mode's progress keeps LightX2V's fraction: its runners report a float
percentage (``progress_callback(33.33.., 100)``) and the wire carries whole steps;
rounded down there, the event stream read ``33 of 100``."""

from __future__ import annotations

import pytest
from mooncake_diffusion_lightx2v import queue_mode

pytestmark = pytest.mark.engines


class Ctx:
    """The part of a ``StageContext`` the progress callback uses."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int]] = []
        self.should_yield = False
        self.cancelled = False

    def progress(self, step: float, total: float) -> None:
        assert type(step) is int and type(total) is int  # what the wire takes
        self.reports.append((step, total))


class Runner:
    stop_signal = False


def test_a_percentage_keeps_its_fraction_on_the_wire():
    ctx, runner = Ctx(), Runner()
    report = queue_mode._progress(ctx, runner)
    for step in range(1, 4):  # DefaultRunner.run_segment: (step / infer_steps) * 100, 100
        report((step / 3) * 100, 100)
    assert ctx.reports == [(3333, 10000), (6667, 10000), (10000, 10000)]
    assert [s / t for s, t in ctx.reports] == pytest.approx([1 / 3, 2 / 3, 1], abs=1e-4)
    assert runner.stop_signal is False


def test_whole_reports_go_as_they_are():
    # rs2v counts clips: progress_callback(idx + 1, total_clips)
    assert queue_mode.progress_steps(2, 5) == (2, 5)
    assert queue_mode.progress_steps(12.5, 100) == (1250, 10000)
    assert queue_mode.progress_steps(100.0, 100) == (10000, 10000)


def test_a_report_after_a_yield_request_stops_the_runner_at_the_step():
    ctx, runner = Ctx(), Runner()
    ctx.should_yield = True
    queue_mode._progress(ctx, runner)(50.0, 100)
    assert ctx.reports == [(5000, 10000)] and runner.stop_signal is True

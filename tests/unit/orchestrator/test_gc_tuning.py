"""The standalone orchestrator's process settings (``service/gc_tuning.py``), in a child
interpreter: freezing is process-wide, so the test process keeps its own collector."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc
from mooncake_diffusion.orchestrator.service.gc_tuning import settle_after_startup
import mooncake_diffusion.orchestrator.http.api  # the web stack: what startup makes
assert gc.get_freeze_count() == 0
seen = len(gc.get_objects())
settle_after_startup()
frozen = gc.get_freeze_count()
assert frozen >= seen // 2, (frozen, seen)
assert len(gc.get_objects()) < seen - frozen // 2  # a full collection walks far less
print("frozen", frozen)
"""


def test_settle_after_startup_takes_startup_objects_out_of_the_collectors_view():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("frozen ")

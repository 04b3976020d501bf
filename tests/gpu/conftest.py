"""The GPU tier: device-memory paths on a real CUDA device.

Without one every test here is reported as skipped with the reason
"not run: no CUDA device", and the run ends with a line saying how many GPU
tests did not run; none is ever counted as passed.
"""

from __future__ import annotations

import pytest

NOT_RUN = "not run: no CUDA device"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(pytest.mark.skip(reason=NOT_RUN))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [
        r for r in terminalreporter.stats.get("skipped", []) if "gpu" in getattr(r, "keywords", {})
    ]
    if skipped:
        terminalreporter.write_line(
            f"GPU tier: {len(skipped)} tests {NOT_RUN} (none counted as passed)", yellow=True
        )

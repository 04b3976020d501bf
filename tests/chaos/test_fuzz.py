"""Fuzzing with Hypothesis: every decoder of outside input gets random and mutated
bytes; bad input gets the decoder's typed error, leaves state unchanged, and nothing
crashes or hangs. A few hundred examples per target here; ``bench/chaos.py`` runs
tens of thousands (``fuzz.run`` is shared)."""

from __future__ import annotations

import fuzz
import pytest

pytestmark = pytest.mark.chaos

EXAMPLES = 60


@pytest.mark.parametrize("name", fuzz.NAMES)
def test_fuzz(name):
    assert fuzz.run(name, EXAMPLES) >= EXAMPLES // 2  # Hypothesis may stop early on small spaces

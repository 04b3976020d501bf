"""The Mooncake wheel of this engine environment matches its torch (tests/wheelcheck.py)."""

import pytest
from wheelcheck import *  # noqa: F403


@pytest.fixture(scope="session")
def vllm_omni() -> None:
    """Replaces conftest's autouse engine start-up here: the check only reads files."""
    return None

"""The Mooncake wheel of this engine environment matches its torch (tests/wheelcheck.py)."""

from wheelcheck import *  # noqa: F403

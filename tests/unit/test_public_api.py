import subprocess
import sys

import pytest

import mooncake_diffusion

pytestmark = pytest.mark.unit


def test_public_surface_is_pinned():
    assert sorted(mooncake_diffusion.__all__) == sorted(
        [
            "DiffusionConnector",
            "LocalCluster",
            "MooncakeSettings",
            "PayloadHandle",
            "Publication",
            "ReceivedPayload",
            "StagePayload",
            "__version__",
            "decode_handle",
            "errors",
        ]
    )
    for name in mooncake_diffusion.__all__:
        assert getattr(mooncake_diffusion, name) is not None


def test_import_loads_neither_mooncake_nor_torch():
    code = (
        "import sys, mooncake_diffusion; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mooncake', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_mooncake_is_an_import_error_that_says_what_to_install():
    code = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from mooncake_diffusion._mooncake import import_mooncake\n"
        "try:\n    import_mooncake('engine')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'mooncake-diffusion[cpu]'" in out.stdout
    assert "mooncake-diffusion[cuda13]" in out.stdout


def test_error_tree_marks_retryable_and_cache_miss_classes():
    e = mooncake_diffusion.errors
    assert issubclass(e.AlreadyConsumedError, e.PayloadGoneError)
    assert issubclass(e.PeerGoneError, e.TransferError) and e.PeerGoneError.retryable
    assert issubclass(e.DestinationMismatchError, ValueError)
    assert issubclass(e.DeadlineExceededError, TimeoutError)
    assert not e.PayloadError.retryable and e.StoreFullError.retryable

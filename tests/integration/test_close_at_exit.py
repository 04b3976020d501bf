"""A Store client or connector left open to a finalizer (``__del__``) closes quietly
at interpreter exit.

An owner's ``__del__`` that runs while the interpreter tears down finds the
modules' globals ``None``; ``StoreClient.close`` once died there with
``AttributeError: 'NoneType' object has no attribute 'unwatch'``. Each case runs a
child process against the real cluster that parks its client on a module imported
before ``mooncake_diffusion`` (so that module is cleared after the client's own),
and leaves it to ``__del__``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from mooncake_diffusion.platform import bindshim
from mooncake_diffusion.testing import assert_no_leaks, thread_names

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent(
    """
    import logging
    import os
    import sys

    import torch

    from mooncake_diffusion.platform.settings import MooncakeSettings


    class Owner:
        \"\"\"Stands in for an engine's connector object: closes its client in __del__.\"\"\"

        def __init__(self, client):
            self.client = client

        def __del__(self, _write=os.write):
            self.client.close()
            _write(1, b"closed\\n")  # close returned


    settings = MooncakeSettings.from_env()
    if sys.argv[1] == "store":
        from mooncake_diffusion._mooncake.store import StoreClient
        from mooncake_diffusion.memory.tensors import describe

        client = StoreClient(settings)
        buf = torch.ones(4096, dtype=torch.uint8)
        client.regs.pin(describe("buf", buf)[1])  # a registration left for close
        client.buf = buf
    else:
        from mooncake_diffusion.transfer.connector import DiffusionConnector

        client = DiffusionConnector("denoise", "store", settings)
    # logging was imported before mooncake_diffusion: its globals are cleared after
    # those of the client's own modules, so __del__ runs with theirs gone
    logging._mcd_owner = Owner(client)
    print("ready", flush=True)
    """
)


@pytest.mark.parametrize("what", ["store", "connector"])
@pytest.mark.parametrize("watch_s", [0.0, 0.5], ids=["unwatched", "watched"])
def test_a_client_left_to_del_closes_quietly_at_exit(mooncake_cluster, what, watch_s):
    baseline = thread_names()
    settings = dataclasses.replace(mooncake_cluster.settings, store_watch_s=watch_s)
    env = dict(os.environ, **settings.as_env(), **bindshim.env(settings.local_hostname))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, what], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ready", "closed"], (proc.stdout, proc.stderr)
    for noise in ("Traceback", "Exception ignored", "Error"):
        assert noise not in proc.stderr, proc.stderr
    assert_no_leaks(mooncake_cluster, baseline)

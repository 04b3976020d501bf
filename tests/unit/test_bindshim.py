"""The bind shim's rule (``platform/bindshim.c``), in a child process it is preloaded
into: any-address stream binds go to the configured host, everything else is left as
asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mooncake_diffusion.platform import bindshim

pytestmark = pytest.mark.unit

CHILD = r"""
import json, socket
out = {}
for name, family, kind, addr in [
    ("v4_any", socket.AF_INET, socket.SOCK_STREAM, "0.0.0.0"),
    ("v6_any", socket.AF_INET6, socket.SOCK_STREAM, "::"),
    ("v4_named", socket.AF_INET, socket.SOCK_STREAM, "127.0.0.2"),
    ("udp_any", socket.AF_INET, socket.SOCK_DGRAM, "0.0.0.0"),
]:
    s = socket.socket(family, kind)
    s.bind((addr, 0))
    out[name] = s.getsockname()[0]
    s.close()
print(json.dumps(out))
"""


def _binds(env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_any_address_stream_binds_go_to_the_configured_host(monkeypatch):
    env = bindshim.env("127.0.0.1")
    if not env:
        pytest.skip("no C compiler: the shim cannot be built (a warning says so)")
    assert env[bindshim.HOST_ENV] == "127.0.0.1" and env["LD_PRELOAD"].endswith(".so")
    got = _binds(env)
    assert got == {
        "v4_any": "127.0.0.1",
        "v6_any": "::ffff:127.0.0.1",  # takes exactly the IPv4 connections to the host
        "v4_named": "127.0.0.2",
        "udp_any": "0.0.0.0",
    }
    assert _binds({})["v4_any"] == "0.0.0.0"  # without it, nothing changes
    # a name resolves to its address; a preload of the process's own is kept
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    again = bindshim.env("localhost")
    assert again == {
        "LD_PRELOAD": f"/opt/other.so {bindshim.library()}",
        "MCD_BIND_HOST": "127.0.0.1",
    }


def test_the_shim_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(bindshim.OFF_ENV, "0")
    assert bindshim.env("127.0.0.1") == {}


def test_check_says_whether_this_process_runs_under_it(caplog):
    env = bindshim.env("127.0.0.1")
    if not env:
        pytest.skip("no C compiler: the shim cannot be built (a warning says so)")
    assert bindshim.check("127.0.0.1") is False  # pytest was not started under it
    assert "start it with LD_PRELOAD=" in caplog.text
    code = "from mooncake_diffusion.platform import bindshim; print(bindshim.check('127.0.0.1'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "True"

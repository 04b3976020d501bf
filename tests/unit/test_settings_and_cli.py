import argparse

import pytest

from mooncake_diffusion import DiffusionConnector, MooncakeSettings
from mooncake_diffusion._mooncake.codes import error_for
from mooncake_diffusion.cli import build_parser, parse_size
from mooncake_diffusion.errors import (
    ConfigError,
    LeasedError,
    MooncakeError,
    PayloadGoneError,
    PeerGoneError,
    StoreFullError,
)
from mooncake_diffusion.transfer.transports import (
    known_transports,
    load_transport,
    register_transport,
)

pytestmark = pytest.mark.unit


def test_settings_from_env_with_overrides(monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    s = MooncakeSettings.from_env(local_hostname="10.0.0.7")
    assert (s.master, s.protocol, s.local_hostname) == ("10.0.0.1:50051", "rdma", "10.0.0.7")
    assert s.admin_address == "10.0.0.1:9003"
    assert MooncakeSettings.from_env(**{}).master == "10.0.0.1:50051"
    assert s.as_env()["MOONCAKE_MASTER"] == "10.0.0.1:50051"
    # a variable set to "" counts as unset (as the adapters' own fallbacks read it)
    monkeypatch.setenv("MOONCAKE_ADMIN", "")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "")
    s = MooncakeSettings.from_env()
    assert (s.admin_address, s.local_hostname) == (
        "10.0.0.1:9003",
        MooncakeSettings().local_hostname,
    )


def test_peer_timeout_from_env_and_back(monkeypatch):
    assert MooncakeSettings().peer_timeout_s == 10.0  # the orchestrator's heartbeat default
    monkeypatch.setenv("MOONCAKE_DIFFUSION_PEER_TIMEOUT_S", "3")
    s = MooncakeSettings.from_env()
    assert s.peer_timeout_s == 3.0
    assert s.as_env()["MOONCAKE_DIFFUSION_PEER_TIMEOUT_S"] == "3.0"
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("MOONCAKE_DIFFUSION_PEER_TIMEOUT_S", bad)
        with pytest.raises(ConfigError, match=r"PEER_TIMEOUT_S|peer_timeout_s"):
            MooncakeSettings.from_env()


@pytest.mark.parametrize("bad", ["nohost", "host:", ":80", "h:99999", "h:x"])
def test_bad_master_address_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="master"):
        MooncakeSettings(master=bad)


def test_connector_rejects_bad_role_and_mode():
    with pytest.raises(ConfigError, match="role"):
        DiffusionConnector("painter", "p2p", MooncakeSettings())
    with pytest.raises(ConfigError, match="transfer_mode"):
        DiffusionConnector("decode", "carrier-pigeon", MooncakeSettings())


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (-200, StoreFullError),
        (-704, PayloadGoneError),
        (-706, LeasedError),
        (-800, PeerGoneError),
        (-600, MooncakeError),
    ],
)
def test_mooncake_codes_become_typed_errors(code, cls):
    err = error_for(code, "put")
    assert type(err) is cls and str(code) in str(err)


def test_registry_is_strict():
    assert {"p2p", "store", "memory"} <= set(known_transports())
    with pytest.raises(ConfigError, match="already registered"):
        register_transport("p2p", "x:Y")
    with pytest.raises(ConfigError, match="known: memory, p2p, store"):
        load_transport("carrier-pigeon")


def test_sizes_and_cli_arguments():
    assert parse_size("1GiB") == 1 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")
    args = build_parser().parse_args(["handoff", "--shape", "1,4,2", "--modes", "store"])
    assert args.shape == (1, 4, 2) and args.modes == ("store",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["handoff", "--modes", "p2p,fax"])

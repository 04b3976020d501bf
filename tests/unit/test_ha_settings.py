"""Mooncake master HA addresses in our settings: ``etcd://h1:p1;h2:p2`` is a valid
master (Mooncake's client form), each endpoint checked; it has no default admin
address; the leader key is where Mooncake 0.3.13 keeps it."""

from __future__ import annotations

import pytest

from mooncake_diffusion._mooncake.master_view import etcd_endpoints, master_view_key
from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.platform.settings import MooncakeSettings, is_etcd_master

pytestmark = pytest.mark.unit


def test_an_etcd_master_is_accepted_and_split_into_endpoints():
    s = MooncakeSettings(master="etcd://10.0.0.1:2379;10.0.0.2:2379")
    assert is_etcd_master(s.master)
    assert etcd_endpoints(s.master) == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert not is_etcd_master("10.0.0.1:50051")


@pytest.mark.parametrize("bad", ["etcd://", "etcd://host", "etcd://a:1;b", "etcd://a:99999"])
def test_a_malformed_etcd_endpoint_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="etcd endpoint"):
        MooncakeSettings(master=bad)


def test_an_etcd_master_needs_an_explicit_admin_address():
    with pytest.raises(ConfigError, match="admin"):
        _ = MooncakeSettings(master="etcd://127.0.0.1:2379").admin_address
    s = MooncakeSettings(master="etcd://127.0.0.1:2379", admin="127.0.0.1:9003")
    assert s.admin_address == "127.0.0.1:9003"


def test_the_leader_key_is_per_cluster_id():
    assert master_view_key() == "mooncake-store/mooncake_cluster/master_view"
    assert master_view_key("t1") == "mooncake-store/t1/master_view"


def test_an_etcd_master_travels_to_a_worker_through_the_environment(monkeypatch):
    s = MooncakeSettings(master="etcd://127.0.0.1:2379;127.0.0.1:2380")
    env = s.as_env()
    assert "MOONCAKE_ADMIN" not in env
    monkeypatch.delenv("MOONCAKE_ADMIN", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    back = MooncakeSettings.from_env()
    assert (back.master, back.admin) == (s.master, None)

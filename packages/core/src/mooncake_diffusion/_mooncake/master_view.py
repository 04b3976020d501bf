"""Where Mooncake master HA says who leads: one etcd key per cluster.

The leading ``mooncake_master -enable_ha`` holds ``mooncake-store/<cluster_id>/
master_view`` (Mooncake 0.3.13; value: its RPC ``host:port``) under a 5 s lease.
Clients name the masters as ``etcd://h1:p1;h2:p2`` and the cluster id in
``MC_STORE_CLUSTER_ID``. ``probe_master`` reads the key here to find whom to probe.
"""

from __future__ import annotations

import os

from mooncake_diffusion.etcd import EtcdClient
from mooncake_diffusion.settings import is_etcd_master

__all__ = ["DEFAULT_CLUSTER_ID", "etcd_endpoints", "leader_rpc_address", "master_view_key"]

#: Mooncake's default ``-cluster_id`` (clients: ``MC_STORE_CLUSTER_ID``)
DEFAULT_CLUSTER_ID = "mooncake_cluster"


def master_view_key(cluster_id: str = DEFAULT_CLUSTER_ID) -> str:
    """The etcd key the leading master holds (Mooncake 0.3.13)."""
    return f"mooncake-store/{cluster_id}/master_view"


def etcd_endpoints(master: str) -> list[str]:
    """The ``host:port`` endpoints of an ``etcd://a;b`` master address."""
    if not is_etcd_master(master):
        raise ValueError(f"not an etcd:// master address: {master!r}")
    return master.removeprefix("etcd://").split(";")


def leader_rpc_address(master: str, cluster_id: str | None = None) -> str | None:
    """The RPC address of the master that leads now, or ``None`` while none does.
    ``cluster_id`` defaults to ``MC_STORE_CLUSTER_ID``, else Mooncake's default.
    Raises ``EtcdUnavailableError`` (an ``OSError``) when no etcd member answers."""
    cid = cluster_id or os.environ.get("MC_STORE_CLUSTER_ID") or DEFAULT_CLUSTER_ID
    value = EtcdClient(etcd_endpoints(master)).get(master_view_key(cid), timeout=1.0)
    return value.decode() if value else None

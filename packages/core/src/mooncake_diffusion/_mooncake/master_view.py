"""What Mooncake master HA keeps in etcd: who leads, and the OpLog.

The leading ``mooncake_master -enable_ha`` holds ``mooncake-store/<cluster_id>/
master_view`` (Mooncake 0.3.13; value: its RPC ``host:port``) under a 5 s lease.
Clients name the masters as ``etcd://h1:p1;h2:p2`` and the cluster id in
``MC_STORE_CLUSTER_ID``. ``probe_master`` reads the key here to find whom to probe.

With ``-enable_oplog`` the leader writes its OpLog under ``/oplog/<cluster_id>/``:
batches at ``batches/<20-digit id>`` and, at ``durable_prefix``, the last batch a
new leader replays. A completed put's entry is written in the background, so a
put answers before its entry is in etcd; ``oplog_puts`` says which objects a
takeover would restore now.
"""

from __future__ import annotations

import json
import os

from mooncake_diffusion.platform.etcd import EtcdClient
from mooncake_diffusion.platform.settings import is_etcd_master

__all__ = [
    "DEFAULT_CLUSTER_ID",
    "etcd_endpoints",
    "leader_rpc_address",
    "master_view_key",
    "oplog_puts",
]

#: Mooncake's default ``-cluster_id`` (clients: ``MC_STORE_CLUSTER_ID``)
DEFAULT_CLUSTER_ID = "mooncake_cluster"
#: OpLog entry kinds (Mooncake 0.3.13 ``OpType``) that add or drop an object
_PUT_END, _PUT_REVOKE, _REMOVE = 1, 2, 3


def master_view_key(cluster_id: str = DEFAULT_CLUSTER_ID) -> str:
    """The etcd key the leading master holds (Mooncake 0.3.13)."""
    return f"mooncake-store/{cluster_id}/master_view"


def etcd_endpoints(master: str) -> list[str]:
    """The ``host:port`` endpoints of an ``etcd://a;b`` master address."""
    if not is_etcd_master(master):
        raise ValueError(f"not an etcd:// master address: {master!r}")
    return master.removeprefix("etcd://").split(";")


def _cluster(cluster_id: str | None) -> str:
    """``cluster_id``, else ``MC_STORE_CLUSTER_ID``, else Mooncake's default."""
    return cluster_id or os.environ.get("MC_STORE_CLUSTER_ID") or DEFAULT_CLUSTER_ID


def leader_rpc_address(master: str, cluster_id: str | None = None) -> str | None:
    """The RPC address of the master that leads now, or ``None`` while none does.
    ``cluster_id`` defaults to ``MC_STORE_CLUSTER_ID``, else Mooncake's default.
    Raises ``EtcdUnavailableError`` (an ``OSError``) when no etcd member answers."""
    value = EtcdClient(etcd_endpoints(master)).get(
        master_view_key(_cluster(cluster_id)), timeout=1.0
    )
    return value.decode() if value else None


def oplog_puts(master: str, cluster_id: str | None = None) -> set[str]:
    """The object keys a takeover would restore now: those put and not revoked or
    removed in the OpLog batches up to ``durable_prefix`` (Mooncake 0.3.13's layout;
    a batch is ``[schema, id, first_seq, last_seq, [[op, tenant, key, payload],
    ...], checksum]``). Empty while nothing is durable. ``master`` and ``cluster_id``
    as for ``leader_rpc_address``."""
    root = f"/oplog/{_cluster(cluster_id)}/"
    found = EtcdClient(etcd_endpoints(master)).get_prefix(root, timeout=1.0)
    prefix = found.get(root + "durable_prefix")
    if prefix is None:
        return set()
    last = int(json.loads(prefix)["batch_id"])
    keys: set[str] = set()
    batches = sorted(k for k in found if k.startswith(root + "batches/"))
    for name in batches:
        batch = json.loads(found[name])
        if int(batch[1]) > last:
            break
        for op, _tenant, key, *_ in batch[4]:
            if op == _PUT_END:
                keys.add(key)
            elif op in (_PUT_REVOKE, _REMOVE):
                keys.discard(key)
    return keys

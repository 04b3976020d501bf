"""Where the Mooncake cluster is and how to reach it."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from mooncake_diffusion.errors import ConfigError

__all__ = ["MooncakeSettings", "expand_env", "is_etcd_master", "split_address"]

_VAR = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_env(value: str, what: str, env: Mapping[str, str] | None = None) -> str:
    """``value`` with every ``$NAME`` and ``${NAME}`` replaced by that environment
    variable. Strict: an unset variable, or a malformed ``${...}``, raises
    ``ConfigError`` naming ``what`` and the variable, at once, instead of being passed
    on literally to fail much later (e.g. as an unresolvable host name). A ``$`` not
    followed by a name or ``{`` stays as it is."""
    env = os.environ if env is None else env

    def sub(m: re.Match[str]) -> str:
        name = m[1] if m[1] is not None else m[2]
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{what}: {m[0]!r} is not a valid variable reference")
        if name not in env:
            raise ConfigError(f"{what}: environment variable {name} is not set (in {value!r})")
        return env[name]

    return _VAR.sub(sub, value)


def split_address(addr: str, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises ``ConfigError`` naming ``what``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be 'host:port', got {addr!r}")
    return host, int(port)


def is_etcd_master(master: str) -> bool:
    """Whether ``master`` is Mooncake's HA form ``etcd://h1:p1;h2:p2``: clients find
    the leading master through etcd (``_mooncake/ha.py``)."""
    return master.startswith("etcd://")


@dataclass(frozen=True)
class MooncakeSettings:
    """Connection settings shared by every connector of a deployment.

    ``master`` is the mooncake_master RPC address. ``admin`` is its HTTP admin
    address (``-metrics_port``, default 9003), used for the fast health probe
    and for listing keys; when ``None`` it is the master's host with port 9003.
    ``local_hostname`` is the address peers use to reach this process.
    ``MOONCAKE_DIFFUSION_SAME_HOST=0`` turns the same-host path off.

    ``store_part_bytes`` caps one Store object (and one batched read): a larger
    chunk is split into parts, so no read runs long enough to outlive the lease
    the master grants it (``-default_kv_lease_ttl``: 10 s by default, 1 s in the
    embedded cluster; 16 MiB takes ~0.15 s at the slowest rate measured on a
    loaded 2-core machine, 0.11 GB/s). 0 means never split. ``store_retry_s``
    bounds the retries of transient Store faults for calls that have no deadline
    of their own. ``store_watch_s`` > 0: every pure Store client of the process is
    recycled when a store host leaves the master's segment list, which is checked
    that often (``_mooncake/segment_watch.py``; one thread per process). 0 (the
    default for a library; stage workers run with 1 s) never recycles.
    ``store_direct_reads``: pure Store clients read objects of 256 KiB or more with a
    polled Transfer Engine of their own instead of Mooncake's get, whose wait spins
    a core (``_mooncake/store.py``); ``MOONCAKE_DIFFUSION_STORE_DIRECT_READS=0``
    turns it off. ``store_lease_s`` is the master's read lease
    (``-default_kv_lease_ttl``) or less: a direct read that ended later than that
    after its lookup is redone, as Mooncake's get redoes one that outlived its
    lease (the master does not tell clients its lease). The default, 1 s, is the
    embedded cluster's; a master started by this package sets it in its settings.
    ``peer_timeout_s``: a p2p producer that acknowledges nothing, not even TCP
    keepalive probes, for this long is gone (``PeerGoneError``: the consuming stage
    reports its input lost and the orchestrator re-runs the stage that made it)
    instead of being waited for until the fetch's deadline. Set it to the
    orchestrator's heartbeat timeout (10 s by default), so a producer the
    orchestrator declares lost is also given up by the consumers it was serving.
    """

    master: str = "127.0.0.1:50051"
    admin: str | None = None
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    connect_timeout_s: float = 5.0
    #: p2p between two processes of one host copies memory directly
    #: (``process_vm_writev``) instead of going through loopback TCP.
    same_host: bool = True
    store_part_bytes: int = 16 << 20
    store_retry_s: float = 10.0
    store_watch_s: float = 0.0
    store_direct_reads: bool = True
    store_lease_s: float = 1.0
    peer_timeout_s: float = 10.0
    #: how device tensors travel: ``auto`` (GPU-direct where Mooncake is a CUDA
    #: build and the NIC reaches GPU memory, else pinned host staging),
    #: ``staged`` or ``gpu-direct``; ``MOONCAKE_DIFFUSION_GPU_PATH``.
    gpu_path: str = "auto"

    def __post_init__(self) -> None:
        if is_etcd_master(self.master):
            for ep in self.master.removeprefix("etcd://").split(";"):
                split_address(ep, "etcd endpoint of master")
        else:
            split_address(self.master, "master")
        if self.admin is not None:
            split_address(self.admin, "admin")
        if self.connect_timeout_s <= 0:
            raise ConfigError("connect_timeout_s must be positive")
        if self.store_part_bytes < 0:
            raise ConfigError("store_part_bytes must be 0 (never split) or positive")
        if self.store_retry_s < 0:
            raise ConfigError("store_retry_s must not be negative")
        if self.store_watch_s < 0:
            raise ConfigError("store_watch_s must be 0 (off) or positive")
        if self.store_lease_s <= 0:
            raise ConfigError("store_lease_s must be positive (the master's read lease)")
        if not (self.peer_timeout_s > 0 and math.isfinite(self.peer_timeout_s)):
            raise ConfigError(f"peer_timeout_s must be positive and finite: {self.peer_timeout_s}")
        if self.gpu_path not in ("auto", "staged", "gpu-direct"):
            raise ConfigError(
                f"gpu_path must be 'auto', 'staged' or 'gpu-direct', got {self.gpu_path!r}"
            )

    @property
    def admin_address(self) -> str:
        if self.admin is not None:
            return self.admin
        if is_etcd_master(self.master):
            raise ConfigError("an etcd:// master has no default admin address: set admin")
        return f"{split_address(self.master)[0]}:9003"

    @classmethod
    def from_env(cls, **overrides: object) -> MooncakeSettings:
        """Settings from ``MOONCAKE_MASTER``, ``MOONCAKE_ADMIN``, ``MOONCAKE_LOCAL_HOSTNAME``,
        ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``, ``MOONCAKE_DIFFUSION_STORE_PART_BYTES``,
        ``MOONCAKE_DIFFUSION_STORE_RETRY_S``, ``MOONCAKE_DIFFUSION_STORE_WATCH_S``,
        ``MOONCAKE_DIFFUSION_STORE_LEASE_S``, ``MOONCAKE_DIFFUSION_PEER_TIMEOUT_S``,
        ``MOONCAKE_DIFFUSION_SAME_HOST`` and
        ``MOONCAKE_DIFFUSION_STORE_DIRECT_READS``;
        explicit ``overrides`` win; the five address and device variables count as
        unset when set to "". A malformed number raises ``ConfigError``."""
        env = {
            "master": os.environ.get("MOONCAKE_MASTER"),
            "admin": os.environ.get("MOONCAKE_ADMIN"),
            "local_hostname": os.environ.get("MOONCAKE_LOCAL_HOSTNAME"),
            "protocol": os.environ.get("MOONCAKE_PROTOCOL"),
            "device": os.environ.get("MOONCAKE_DEVICE"),
        }
        merged: dict[str, object] = {k: v for k, v in env.items() if v}  # "" is unset
        for field, var, conv in (
            ("store_part_bytes", "MOONCAKE_DIFFUSION_STORE_PART_BYTES", int),
            ("store_retry_s", "MOONCAKE_DIFFUSION_STORE_RETRY_S", float),
            ("store_watch_s", "MOONCAKE_DIFFUSION_STORE_WATCH_S", float),
            ("store_lease_s", "MOONCAKE_DIFFUSION_STORE_LEASE_S", float),
            ("peer_timeout_s", "MOONCAKE_DIFFUSION_PEER_TIMEOUT_S", float),
        ):
            raw = os.environ.get(var)
            if raw is not None:
                try:
                    merged[field] = conv(raw)
                except ValueError:
                    raise ConfigError(f"{var} must be a number, got {raw!r}") from None
        for field, var in (
            ("same_host", "MOONCAKE_DIFFUSION_SAME_HOST"),
            ("store_direct_reads", "MOONCAKE_DIFFUSION_STORE_DIRECT_READS"),
        ):
            raw = os.environ.get(var)
            if raw is not None:
                merged[field] = raw.strip().lower() not in ("0", "false", "no", "off")
        gpu_path = os.environ.get("MOONCAKE_DIFFUSION_GPU_PATH")
        if gpu_path is not None:
            merged["gpu_path"] = gpu_path.strip().lower()
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **merged)  # type: ignore[arg-type]

    def as_env(self) -> dict[str, str]:
        """The environment variables that ``from_env`` reads back to these settings,
        in a fixed order (``cluster up`` prints them as exports; the admin address
        comes right after the master, and not at all for an HA master without one;
        ``store_watch_s`` only when on, so a worker started with them keeps its own
        default)."""
        env = {"MOONCAKE_MASTER": self.master}
        if self.admin is not None or not is_etcd_master(self.master):
            env["MOONCAKE_ADMIN"] = self.admin_address  # an HA master has no default one
        env |= {
            "MOONCAKE_LOCAL_HOSTNAME": self.local_hostname,
            "MOONCAKE_PROTOCOL": self.protocol,
            "MOONCAKE_DIFFUSION_STORE_PART_BYTES": str(self.store_part_bytes),
            "MOONCAKE_DIFFUSION_STORE_RETRY_S": str(self.store_retry_s),
            "MOONCAKE_DIFFUSION_STORE_LEASE_S": str(self.store_lease_s),
            "MOONCAKE_DIFFUSION_PEER_TIMEOUT_S": str(self.peer_timeout_s),
        }
        if self.store_watch_s:
            env["MOONCAKE_DIFFUSION_STORE_WATCH_S"] = str(self.store_watch_s)
        if not self.store_direct_reads:
            env["MOONCAKE_DIFFUSION_STORE_DIRECT_READS"] = "0"
        return env

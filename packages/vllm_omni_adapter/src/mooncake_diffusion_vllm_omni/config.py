"""The connector's settings: the deploy YAML's ``extra`` mapping, with env fallbacks.

``ConnectorConfig.from_extra(extra)`` reads, in order of precedence, the key in
``extra`` (``$VAR``/``${VAR}`` expanded strictly: an unset variable is a
``ConfigError`` at construction, as later vLLM-Omni does for its own connectors),
then the environment variable, then the default:

    key                 env fallback                      default
    master              MOONCAKE_MASTER                   127.0.0.1:50051
    admin               MOONCAKE_ADMIN                    master host, port 9003
    host                MOONCAKE_LOCAL_HOSTNAME           127.0.0.1 ("auto": this host's IP)
    protocol / proto    MOONCAKE_PROTOCOL                 tcp
    device_name / rdma  MOONCAKE_DEVICE, RDMA_DEVICE_NAME ""
    transfer_mode       MOONCAKE_DIFFUSION_TRANSFER_MODE  store   (store | p2p | auto)
    ttl_s               MOONCAKE_DIFFUSION_TTL_S          600     (0: no TTL)
    sweep_s                                               ttl_s/4 within 1..60 (0: none)
    timeout_s                                             30
    connect_timeout_s                                     5
    inline_bytes                                          65536
    max_record                                            1048576
    receive_device                                        cpu
    keep_on_close                                         true in store mode, else false
    gpu_direct                                            false

Core's other settings come from its environment variables as in every process
(``MooncakeSettings.from_env``: ``MOONCAKE_DIFFUSION_PEER_TIMEOUT_S``, ``_GPU_PATH``,
``_SAME_HOST``, ``_STORE_PART_BYTES``, ``_STORE_LEASE_S`` and the rest).
``receive_device`` must be a torch device name; a typo fails at construction.

Keys the runtime injects (``stage_id``, ``role``, ``from_stage``, ``to_stage``,
``type``, ``sender_host``, ``sender_zmq_port``, ``zmq_port``), the chunk knobs
stage input processors read from ``connector.config`` (``codec_chunk_frames``
and the like) and the built-in MooncakeStoreConnector's sizing keys
(``metadata_server``, ``segment``, ``localbuf``: this connector needs no local
buffer) are accepted and left alone. Any other key is accepted too, since the
runtime may add more, and named once in a warning so a typo does not go
unnoticed. A value of the wrong type raises ``ConfigError``.

Why a TTL of 600 s. Whatever nobody takes has to go without anyone calling
``cleanup`` (vLLM-Omni 0.30.0 never calls it on third-party connectors, Dynamo
never does: a request Dynamo's router fails, e.g. while stage 1 is down, leaves
stage 0's output behind), so there is a default, and it is the longest vLLM-Omni
itself waits for a request's output (``_ASYNC_OUTPUT_TIMEOUT_DEFAULT``, 600 s, in
``diffusion/diffusion_engine.py``): a payload that sat longer belongs to a request
that has already failed, so expiry takes only leftovers. Its other long waits
(stage start-up 300 s, init 600 s, the device phase lock 900 s) come before a
stage serves requests, so no payload waits through them. Raise ``ttl_s`` with
``VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT``.
An expiry is logged as a warning and counted (``health()["expired"]``). Set
``ttl_s: 0`` to keep payloads until taken or cleaned up.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.platform.settings import MooncakeSettings, expand_env

__all__ = ["IGNORED_KEYS", "ConnectorConfig"]

_log = logging.getLogger("mooncake_diffusion_vllm_omni")

#: Keys read by this module.
_KNOWN = {
    "master",
    "admin",
    "host",
    "local_hostname",
    "protocol",
    "proto",
    "device_name",
    "rdma",
    "transfer_mode",
    "ttl_s",
    "timeout_s",
    "connect_timeout_s",
    "inline_bytes",
    "max_record",
    "receive_device",
    "keep_on_close",
    "gpu_direct",
    "sweep_s",
}
#: Keys the vLLM-Omni runtime injects or other readers of ``connector.config`` use.
IGNORED_KEYS = frozenset(
    {
        "stage_id",
        "role",
        "from_stage",
        "to_stage",
        "type",
        "sender_host",
        "sender_zmq_port",
        "zmq_port",
        "metadata_server",
        "segment",
        "localbuf",
        "codec_chunk_frames",
        "codec_left_context_frames",
        "initial_codec_chunk_frames",
    }
)
_MODES = ("store", "p2p", "auto")
_AUTO_HOSTS = {"", "auto", "*", "0.0.0.0", "::"}
_warned: set[str] = set()


def _local_ip() -> str:
    """This host's outward-facing IP (no packet is sent), or loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector needs; ``settings`` is core's ``MooncakeSettings``."""

    settings: MooncakeSettings
    transfer_mode: str = "store"
    ttl_s: float | None = 600.0
    timeout_s: float = 30.0
    inline_bytes: int = 64 << 10
    max_record: int = 1 << 20
    receive_device: str = "cpu"
    keep_on_close: bool | None = None
    gpu_direct: bool = False
    sweep_s: float | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``extra`` (see the module docstring); raises ``ConfigError``."""
        extra = dict(extra or {})
        for key in sorted(set(extra) - _KNOWN - IGNORED_KEYS - _warned):
            _warned.add(key)
            _log.warning("MooncakeDiffusionConnector: unknown extra key %r ignored", key)

        def pick(*names: str, env: tuple[str, ...] = (), default: Any = None) -> Any:
            for name in names:
                if extra.get(name) is not None:
                    v = extra[name]
                    return expand_env(v, f"extra[{name!r}]") if isinstance(v, str) else v
            for var in env:
                if os.environ.get(var):
                    return os.environ[var]
            return default

        host = str(pick("host", "local_hostname", env=("MOONCAKE_LOCAL_HOSTNAME",), default=""))
        if host in _AUTO_HOSTS:
            host = _local_ip() if host else "127.0.0.1"
        mode_env = ("MOONCAKE_DIFFUSION_TRANSFER_MODE",)
        mode = str(pick("transfer_mode", env=mode_env, default="store"))
        if mode not in _MODES:
            raise ConfigError(f"transfer_mode must be one of {_MODES}, got {mode!r}")
        try:
            # from_env: core's MOONCAKE_DIFFUSION_* variables (peer timeout, GPU path,
            # same-host, store parts and leases) apply here as in every other process
            settings = MooncakeSettings.from_env(
                master=str(pick("master", env=("MOONCAKE_MASTER",), default="127.0.0.1:50051")),
                admin=pick("admin", env=("MOONCAKE_ADMIN",)),
                local_hostname=host,
                protocol=str(pick("protocol", "proto", env=("MOONCAKE_PROTOCOL",), default="tcp")),
                device=str(
                    pick(
                        "device_name",
                        "rdma",
                        env=("MOONCAKE_DEVICE", "RDMA_DEVICE_NAME"),
                        default="",
                    )
                ),
                connect_timeout_s=_number(
                    pick("connect_timeout_s", default=5.0), "connect_timeout_s", positive=True
                ),
            )
            ttl_env = ("MOONCAKE_DIFFUSION_TTL_S",)
            ttl = _number(pick("ttl_s", env=ttl_env, default=600.0), "ttl_s")
            keep = pick("keep_on_close")
            sweep = pick("sweep_s")
            return cls(
                settings=settings,
                transfer_mode=mode,
                ttl_s=ttl if ttl > 0 else None,
                timeout_s=_number(pick("timeout_s", default=30.0), "timeout_s", positive=True),
                inline_bytes=int(_number(pick("inline_bytes", default=64 << 10), "inline_bytes")),
                max_record=int(
                    _number(pick("max_record", default=1 << 20), "max_record", positive=True)
                ),
                receive_device=_device(pick("receive_device", default="cpu")),
                keep_on_close=None if keep is None else _flag(keep, "keep_on_close"),
                gpu_direct=_flag(pick("gpu_direct", default=False), "gpu_direct"),
                sweep_s=None if sweep is None else _number(sweep, "sweep_s"),
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"MooncakeDiffusionConnector extra: {e}") from None


def _device(v: Any) -> str:
    """``receive_device`` as torch names it ("cpu", "cuda", "cuda:1"); a typo fails
    here, not at every receive (each of which would consume the payload first)."""
    import torch

    try:
        return str(torch.device(str(v)))
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"receive_device must be a torch device such as 'cpu' or 'cuda:0', got {v!r}"
        ) from None


def _number(v: Any, name: str, *, positive: bool = False) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"{name} must be a number, got {v!r}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {v!r}") from None
    if x < 0 or (positive and x == 0):
        raise ConfigError(f"{name} must be {'positive' if positive else '>= 0'}, got {v!r}")
    return x


def _flag(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    word = v.strip().lower() if isinstance(v, str) else None
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {v!r}")

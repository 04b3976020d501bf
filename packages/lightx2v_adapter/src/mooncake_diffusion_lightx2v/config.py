"""``disagg_config`` (LightX2V's role JSON) -> the adapter's settings.

Read once per runner by ``init_disagg``. LightX2V's own keys keep their
meaning (``disagg_mode``, ``bootstrap_room``, ``decoder_bootstrap_room``,
``decoder_engine_rank``); the Mooncake keys it documents but ignores
(``local_hostname``, ``protocol``, ``device_name``) are honoured; the rest are
the adapter's own. Unknown keys are left alone (LightX2V has many).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion_lightx2v.selection import BACKEND, selects_adapter

__all__ = ["BACKEND", "AdapterConfig", "QueueConfig", "selects_adapter"]

_MODES = ("p2p", "store", "auto")
_ROLES = {"encoder": "encode", "transformer": "denoise", "decode": "decode"}
_QUEUE_KEYS = {
    "orchestrator",
    "credits",
    "token",
    "worker_id",
    "labels",
    "result_sha256",
    "connect_timeout_s",
}


def _number(
    d: Mapping[str, Any],
    key: str,
    default: float,
    kind: type = float,
    where: str = "disagg_config",
) -> Any:
    value = d.get(key, default)
    bad = ConfigError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
    if isinstance(value, bool):  # JSON true is not 1
        raise bad
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise bad  # 2.7 is not a count (int() would make it 2)
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise bad from None
    if out <= 0:
        raise ConfigError(f"{where}.{key} must be positive, got {value!r}")
    return out


def _flag(
    d: Mapping[str, Any], key: str, default: bool | None, where: str = "disagg_config"
) -> bool | None:
    """A JSON boolean (absent or null: ``default``); a string such as "false" is refused,
    since ``bool("false")`` is true."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _first_given(*values: Any) -> Any:
    """The first value that is not None: a key set to null is a key not given."""
    return next(v for v in values if v is not None)


@dataclass(frozen=True)
class QueueConfig:
    """``disagg_config.queue``: this role serves the orchestrator's queue of its stage
    (encoder: ``encode``, transformer: ``denoise``, decode: ``decode``)."""

    #: the orchestrator's worker endpoint, ``tcp://host:port``
    orchestrator: str
    #: items the orchestrator may hand this role at once (the runner runs one at a time)
    credits: int
    #: the orchestrator's token (else ``$MCD_ORCHESTRATOR_TOKEN``)
    token: str | None
    #: the worker's id (default ``<stage>-<host>-<pid>``)
    worker_id: str | None
    labels: dict[str, str]
    #: decode: add the SHA-256 of the result tensor to the request's output JSON
    result_sha256: bool
    #: how long the worker keeps saying Hello before it gives up
    connect_timeout_s: float

    @classmethod
    def parse(cls, raw: Any) -> QueueConfig:
        """Parse ``disagg_config.queue``; raises ``ConfigError`` naming the bad key."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                'disagg_config.queue must be an object: {"orchestrator": "tcp://host:port", '
                '"credits": 1}'
            )
        unknown = sorted(set(raw) - _QUEUE_KEYS)
        if unknown:
            raise ConfigError(
                f"disagg_config.queue: unknown keys {unknown} (known: {sorted(_QUEUE_KEYS)})"
            )
        address = raw.get("orchestrator")
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise ConfigError(
                "disagg_config.queue.orchestrator must be the orchestrator's worker "
                f"endpoint, tcp://host:port, got {address!r}"
            )
        labels = raw.get("labels", {})
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise ConfigError("disagg_config.queue.labels must map strings to strings")
        for key in ("token", "worker_id"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise ConfigError(f"disagg_config.queue.{key} must be a string")
        return cls(
            orchestrator=address,
            credits=_number(raw, "credits", 1, int, "disagg_config.queue"),
            token=raw.get("token"),
            worker_id=raw.get("worker_id"),
            labels=dict(labels),
            result_sha256=bool(_flag(raw, "result_sha256", False, "disagg_config.queue")),
            connect_timeout_s=_number(
                raw, "connect_timeout_s", 300.0, float, "disagg_config.queue"
            ),
        )


@dataclass(frozen=True)
class AdapterConfig:
    """Everything the adapter reads from a runner config (see the README's key table)."""

    disagg_mode: str
    connector_role: str
    settings: MooncakeSettings
    transfer_mode: str
    channel: str
    #: a transformer that hands latents to a decoder (``decoder_engine_rank`` set)
    sends_phase2: bool
    latent_chunks: int
    verify: bool
    timeout_s: float
    ttl_s: float
    receive_pool_bytes: int
    #: queue mode (``disagg_config.queue``); ``None``: LightX2V's rooms
    queue: QueueConfig | None = None

    @classmethod
    def from_runner_config(cls, config: Mapping[str, Any]) -> AdapterConfig:
        """Parse; raises ``ConfigError`` naming the bad key."""
        disagg = config.get("disagg_config") or {}
        mode = config.get("disagg_mode")
        if mode not in _ROLES:
            raise ConfigError(
                f"disagg_mode must be one of {sorted(_ROLES)} with transfer_backend "
                f"{BACKEND!r}, got {mode!r}"
            )
        if disagg.get("decentralized_queue"):
            raise ConfigError(
                "disagg_config.decentralized_queue (LightX2V's RDMA-ring queue) is not "
                f"supported with transfer_backend {BACKEND!r}: use the adapter's queue mode, "
                '"queue": {"orchestrator": "tcp://host:port", "credits": 1} in disagg_config, '
                "which makes the roles mooncake-diffusion orchestrator workers"
            )
        queue = QueueConfig.parse(disagg["queue"]) if disagg.get("queue") is not None else None
        transfer_mode = disagg.get("transfer_mode", "auto")
        if transfer_mode not in _MODES:
            raise ConfigError(f"disagg_config.transfer_mode must be one of {_MODES}")
        settings = MooncakeSettings.from_env(
            master=disagg.get("master"),
            admin=disagg.get("admin"),
            local_hostname=disagg.get("local_hostname"),
            protocol=disagg.get("protocol"),
            device=disagg.get("device_name"),
            same_host=_flag(disagg, "same_host", None),  # None: the environment's, or on
        )
        channel = str(disagg.get("channel", "lightx2v"))
        if not channel or "/" in channel:
            raise ConfigError("disagg_config.channel must be a non-empty name without '/'")
        verify = disagg.get("verify", False)
        if verify not in (True, False, "crc32", "none"):
            raise ConfigError("disagg_config.verify must be true, false, 'crc32' or 'none'")
        return cls(
            disagg_mode=mode,
            connector_role=_ROLES[mode],
            settings=settings,
            transfer_mode=transfer_mode,
            channel=channel,
            # queue mode: the orchestrator's stage graph always has a decode stage
            sends_phase2=mode == "transformer"
            and (queue is not None or disagg.get("decoder_engine_rank") is not None),
            latent_chunks=_number(disagg, "latent_chunks", 4, int),
            verify=verify in (True, "crc32"),
            timeout_s=_number(disagg, "timeout_s", 600.0),
            ttl_s=_number(disagg, "ttl_s", 600.0),
            receive_pool_bytes=_number(disagg, "receive_pool_mb", 256, int) << 20,
            queue=queue,
        )

    @staticmethod
    def room(config: Mapping[str, Any], phase: int) -> int:
        """The room of ``phase`` for this request, as LightX2V picks it: Phase 1 is
        ``data_bootstrap_room`` (a per-request override) or ``bootstrap_room``
        (default 0); Phase 2 is ``decoder_bootstrap_room`` on the transformer and
        ``bootstrap_room`` on the decoder (default 1). Read on every call, since a
        server's ``set_config`` may change them per request."""
        disagg = config.get("disagg_config") or {}
        try:
            if phase == 1:
                return int(
                    _first_given(config.get("data_bootstrap_room"), disagg.get("bootstrap_room"), 0)
                )
            if config.get("disagg_mode") == "transformer":
                return int(_first_given(disagg.get("decoder_bootstrap_room"), 1))
            return int(_first_given(disagg.get("bootstrap_room"), 1))
        except (TypeError, ValueError):
            raise ConfigError(f"the Phase {phase} bootstrap room must be an int") from None

    def mailbox_name(self, phase: int, room: int, seq: int) -> str:
        """Where the handle of the ``seq``-th payload of a (phase, room) channel goes."""
        return f"{self.channel}/p{phase}/{room}/{seq}"

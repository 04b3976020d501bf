"""``MooncakeDiffusionConnector``: vLLM-Omni's ``OmniConnectorBase`` on mooncake-diffusion.

How vLLM-Omni calls it (every call is synchronous, from the stage processes):

    __init__(extra)                 OmniConnectorFactory.create_connector(spec)
                                    in each process that moves data for an edge
    put(from, to, put_key, data)    the producer's save loop / chunk adapter / KV
                                    manager; one put per chunk, each its own key
    reap_consumed()                 after every save-loop iteration (bounded, cheap)
    get(from, to, get_key, meta)    polled by the consumer's threads: the object, or
                                    None at once when not there yet
    get_with_deadline(..., deadline=t)  the diffusion stage payload (polls until t)
    abandon_get(get_key)            after that deadline loop (nothing to retire)
    cleanup(request_id)             abort paths: drop what is left of the request
    health() / close()              close is idempotent, also after a failed init

Translation only. Data is found by key alone (the runtime drops ``put()``
metadata): ``core.keyed.KeyedHandoff`` publishes the tensors of ``data``
through ``DiffusionConnector`` (store mode by default: the bytes outlive the
producer) and posts the handle and the object's skeleton in a Store mailbox
under ``f"{put_key}@{from_stage}_{to_stage}"``; ``get`` takes that record and
consumes the tensors into fresh memory, once. Transfer, leases, TTLs and
cleanup rules are core's.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase

from mooncake_diffusion_vllm_omni.config import ConnectorConfig
from mooncake_diffusion_vllm_omni.types import register_types

__all__ = ["MooncakeDiffusionConnector"]

_log = logging.getLogger("mooncake_diffusion_vllm_omni")
_REAP_INTERVAL_S = 0.5


class MooncakeDiffusionConnector(OmniConnectorBase):
    """A drop-in OmniConnector on Mooncake; select it with ``name: MooncakeDiffusionConnector``.

    ``supports_raw_data``: the KV manager may hand ``put`` raw ``bytes`` or a 1-D
    uint8 tensor, on a GPU too; both move without serialisation. Device tensors
    (raw or inside a payload) are copied to host first unless ``gpu_direct: true``
    (a Mooncake build that registers device memory; untested here, no GPU). ``get``
    returns raw bytes (``bytes``, ``bytearray`` or ``memoryview`` put) as ``bytes``
    and a raw tensor as a host uint8 tensor, byte for byte what was put.

    Objects come back as the built-in codec rebuilds them: tensors, numpy arrays,
    ``PIL.Image``, ``slice``, vLLM ``RequestOutput`` / ``CompletionOutput`` and
    ``OmniRequestOutput`` as their own classes (see ``types.py``), other dataclasses
    and msgspec Structs as dicts, tuples as lists. Nothing is pickled.

    Construction raises (the factory turns it into ``ValueError``) when the
    master is not reachable within ``connect_timeout_s``, or on bad ``extra``.
    """

    supports_raw_data = True

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.stage_id = int(config.get("stage_id", -1))
        self._closed = False
        self._handoff: Any = None
        self._last_reap = 0.0
        self._lock = threading.Lock()
        self._metrics = {
            "puts": 0,
            "gets": 0,
            "misses": 0,
            "bytes_put": 0,
            "bytes_got": 0,
            "errors": 0,
        }
        self._last_error = ""
        self.settings = ConnectorConfig.from_extra(config)
        from mooncake_diffusion.handoff.keyed import KeyedHandoff

        register_types()  # vLLM's output classes travel as themselves

        s = self.settings
        self._handoff = KeyedHandoff(
            s.settings,
            transfer_mode=s.transfer_mode,  # type: ignore[arg-type]
            inline_bytes=s.inline_bytes,
            max_record=s.max_record,
            ttl_s=s.ttl_s,
            timeout_s=s.timeout_s,
            device=s.receive_device,
            keep_on_close=s.keep_on_close,
            to_host=not s.gpu_direct,
            sweep_s=s.sweep_s,
        )

    # ------------------------------------------------------------ the contract
    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Publish ``data`` under ``put_key`` for the edge; blocks until a consumer can
        take it. Returns ``(True, nbytes, {"key", "size"})`` or, on any failure (logged,
        counted in ``health()``), ``(False, 0, None)`` with nothing left behind."""
        key = self._make_key(put_key, from_stage, to_stage)
        try:
            n = self._handoff.send(key, data)
        except Exception as e:
            self._fail(f"put {key}", e)
            return False, 0, None
        self._count(puts=1, bytes_put=n)
        self._last_error = ""  # health() reports the state now, not a past failure
        return True, n, {"key": key, "size": n}

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        """``(object, nbytes)`` once ``get_key`` was put for the edge, else ``None`` at
        once. Consumes: a second get of the key returns ``None``. ``metadata`` is not
        needed (the key addresses the payload) and is ignored. A payload whose record
        was there but whose bytes were not is logged, counted and reported as None."""
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            got = self._handoff.receive(key)
        except Exception as e:
            self._fail(f"get {key}", e)
            return None
        return self._got(got)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """``get`` polled with bounded backoff until ``deadline`` (``time.monotonic()``)."""
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            got = self._handoff.receive_until(key, deadline)
        except Exception as e:
            self._fail(f"get {key}", e)
            return None
        return self._got(got)

    def abandon_get(self, get_key: str) -> None:
        """Nothing to retire: a get claims nothing until it takes the record."""

    def reap_consumed(self) -> None:
        """Forget sent keys that consumers took (at most every 0.5 s, 64 keys, one
        round trip); errors are logged, never raised into the save loop."""
        now = time.monotonic()
        if self._closed or now - self._last_reap < _REAP_INTERVAL_S:
            return
        self._last_reap = now
        try:
            self._handoff.reap()
        except Exception as e:
            self._fail("reap_consumed", e)

    def cleanup(self, request_id: str) -> None:
        """Remove what is left of ``request_id`` on every edge, in the whole store: the
        exact put key, and vLLM-Omni's chunk keys ``f"{request_id}_{stage}_{chunk}"``
        (integers), both unconsumed records and their bytes. Exact: keys of other
        requests that merely start with ``request_id`` (``f"{request_id}__cfg_text"``,
        ``f"{request_id}_x_0_0"``) stay. Never needed for reclamation: what nobody
        takes expires after ``ttl_s`` (see ``config.py``)."""
        if self._closed:
            return
        pattern = re.escape(request_id) + r"(_\d+_\d+)?@"
        try:
            self._handoff.discard_matching(pattern)
        except Exception as e:
            self._fail(f"cleanup {request_id}", e)

    def health(self) -> dict[str, Any]:
        """Counters, the store's address and ``last_error``: the latest failure, cleared
        by the next put or get that succeeds."""
        if self._closed or self._handoff is None:
            return {"status": "closed"}
        with self._lock:
            metrics = dict(self._metrics)
        return {
            "status": "healthy",
            "master": self.settings.settings.master,
            "transfer_mode": self.settings.transfer_mode,
            "pending": len(self._handoff.pending()),
            "expired": self._handoff.expired,
            "last_error": self._last_error,
            **metrics,
        }

    def close(self) -> None:
        """Disconnect. In store mode untaken puts stay for their consumers (until taken,
        cleaned up or expired); in p2p mode (or with ``keep_on_close: false``) they are
        removed, since their bytes leave with this process. Idempotent; safe after a
        failed ``__init__`` (``__del__`` calls it)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        handoff, self._handoff = getattr(self, "_handoff", None), None
        if handoff is not None:
            handoff.close()

    # ------------------------------------------------------------ helpers
    def _got(self, got: tuple[Any, int] | None) -> tuple[Any, int] | None:
        if got is None:
            self._count(misses=1)
            return None
        self._count(gets=1, bytes_got=got[1])
        self._last_error = ""
        return got

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, d in delta.items():
                self._metrics[k] += d

    def _fail(self, what: str, e: Exception) -> None:
        self._count(errors=1)
        self._last_error = f"{what}: {type(e).__name__}: {e}"
        _log.error("MooncakeDiffusionConnector %s", self._last_error)

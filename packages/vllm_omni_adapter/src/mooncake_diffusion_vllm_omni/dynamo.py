"""An opt-in hook in NVIDIA Dynamo's omni router: a request a stage fails is cleaned up at once.

Opt-in: set ``MOONCAKE_DIFFUSION_DYNAMO_RECLAIM=1`` (``true``/``yes``/``on``; unset,
empty or ``0``/``false``/``no``/``off``: off, the default; anything else raises
``ConfigError`` when a connector is built) in the environment of ``python -m
dynamo.vllm.omni --omni-router``. Without it, a payload put for a stage that
then fails stays in the store until ``ttl_s`` (docs/dynamo.md). Importing this
module imports neither Dynamo nor vLLM-Omni nor Mooncake.

Dynamo 1.6.1's router never calls a connector method when a stage call fails
(``OmniStageRouter.generate`` has no ``try`` around its stage loop), so the hook
wraps the stage clients the router is given. In the order it happens:

    install_if_enabled()     ``plugin._create``, each time this process builds a
                             MooncakeDiffusionConnector (the router builds its
                             connectors in ``OmniStageRouter.__init__``, before it
                             sets any stage client); with the setting on and
                             ``dynamo.vllm.omni.stage_router`` loaded, wraps
                             ``OmniStageRouter.set_stage_client`` once per process
    set_stage_client(s, c)   Dynamo's ``init_omni_stage_router``, once per stage: the
                             router stores ``_ReclaimingClient(c)`` instead of ``c``
    await c.round_robin(req) the router's ``generate``, once per stage and request
                             (also ``random``, ``direct``, ``generate``)
    reclaim                  when that call raises, its stream raises, or a chunk of
                             it carries ``error``: ``cleanup(req["request_id"])`` on
                             each of the router's MooncakeDiffusionConnectors, in a
                             worker thread, awaited before the error goes on

Awaited, so when the client has the error the store holds nothing of that
request; the error waits that long (one scan of the master's keys per connector;
``cleanup`` logs and swallows its own failures). ``cleanup`` removes the request
from the whole store, leased records included, whichever process put them.

Not covered: a request the client abandons (cancellation is not a stage
error: stage 1 may still be reading), and a failure after the last stage
answered (the router's own ``get`` of the final output).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from typing import Any

from mooncake_diffusion.errors import ConfigError

__all__ = ["RECLAIM_ENV", "enabled", "install", "install_if_enabled"]

#: The setting: the environment variable that turns the hook on in the router process.
RECLAIM_ENV = "MOONCAKE_DIFFUSION_DYNAMO_RECLAIM"
_ROUTER_MODULE = "dynamo.vllm.omni.stage_router"
_MARK = "__mooncake_diffusion_reclaim__"
_log = logging.getLogger("mooncake_diffusion_vllm_omni")
_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``RECLAIM_ENV`` turns the hook on; raises ``ConfigError`` on a bad value."""
    raw = os.environ.get(RECLAIM_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{RECLAIM_ENV} must be true or false, got {os.environ[RECLAIM_ENV]!r}")


def install_if_enabled() -> bool:
    """``install()`` when the setting is on and Dynamo's router module is loaded (it
    imports nothing); ``True`` once the hook is in place. Cheap; call it freely."""
    if not enabled():
        return False
    module = sys.modules.get(_ROUTER_MODULE)
    router_cls = getattr(module, "OmniStageRouter", None)
    return router_cls is not None and install(router_cls)


def install(router_cls: type) -> bool:
    """Wrap ``router_cls.set_stage_client`` so that every stage client it stores
    reclaims a failed request's payloads. Idempotent, thread-safe; returns ``True``."""
    with _lock:
        original = router_cls.set_stage_client
        if getattr(original, _MARK, False):
            return True

        def set_stage_client(self: Any, model_stage: str, client: Any) -> None:
            return original(self, model_stage, _ReclaimingClient(client, self, model_stage))

        set_stage_client.__doc__ = original.__doc__
        setattr(set_stage_client, _MARK, True)
        router_cls.set_stage_client = set_stage_client
    _log.info("Dynamo router: %s is on: a request a stage fails is cleaned up", RECLAIM_ENV)
    return True


class _ReclaimingClient:
    """A Dynamo stage ``Client`` whose request calls reclaim on failure; every other
    attribute is the wrapped client's."""

    def __init__(self, inner: Any, router: Any, stage: str) -> None:
        self._inner, self._router, self._stage = inner, router, stage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def round_robin(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._call("round_robin", request, *args, **kwargs)

    async def random(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._call("random", request, *args, **kwargs)

    async def direct(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._call("direct", request, *args, **kwargs)

    async def generate(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._call("generate", request, *args, **kwargs)

    async def _call(self, how: str, request: Any, *args: Any, **kwargs: Any) -> Any:
        rid = request.get("request_id") if isinstance(request, dict) else None
        try:
            stream = await getattr(self._inner, how)(request, *args, **kwargs)
        except Exception as e:
            await self.reclaim(rid, f"{how} raised {type(e).__name__}: {e}")
            raise
        return _WatchedStream(stream, self, rid)

    async def reclaim(self, request_id: Any, why: str) -> None:
        """``cleanup(request_id)`` on each of the router's MooncakeDiffusionConnectors,
        in a worker thread; never raises (the stage's error is what goes on)."""
        if not isinstance(request_id, str) or not request_id:
            return
        from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector

        ours: list[Any] = []
        for c in dict(getattr(self._router, "connectors", None) or {}).values():
            if isinstance(c, MooncakeDiffusionConnector) and all(c is not o for o in ours):
                ours.append(c)
        if not ours:
            return

        def cleanup_all() -> None:
            for c in ours:
                c.cleanup(request_id)

        try:
            await asyncio.to_thread(cleanup_all)
        except Exception as e:  # cleanup logs its own; this is anything else
            _log.error("Dynamo router: reclaiming request %s failed: %s", request_id, e)
            return
        _log.warning(
            "Dynamo router: stage %s failed request %s (%s): reclaimed its payloads",
            self._stage,
            request_id,
            why,
        )


class _WatchedStream:
    """A stage call's response stream that reclaims (once) when iterating it raises
    or a chunk carries ``error``; chunks go on unchanged."""

    def __init__(self, inner: Any, client: _ReclaimingClient, request_id: Any) -> None:
        self._inner, self._client, self._rid = inner, client, request_id
        self._it: Any = None
        self._reclaimed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __aiter__(self) -> _WatchedStream:
        return self

    async def __anext__(self) -> Any:
        if self._it is None:
            self._it = self._inner.__aiter__()
        try:
            chunk = await self._it.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as e:
            await self._reclaim(f"its stream raised {type(e).__name__}: {e}")
            raise
        read = getattr(chunk, "data", None)
        if callable(read):
            chunk = _Chunk(chunk, read())
            if chunk.error:
                await self._reclaim(f"it answered error: {chunk.error}")
        return chunk

    async def _reclaim(self, why: str) -> None:
        if not self._reclaimed:
            self._reclaimed = True
            await self._client.reclaim(self._rid, why)


class _Chunk:
    """A response item whose ``data()`` was read once (here) and is served from then on."""

    def __init__(self, inner: Any, data: Any) -> None:
        self._inner, self._data = inner, data
        body = data
        if isinstance(body, (str, bytes, bytearray)):
            try:
                body = json.loads(body)
            except ValueError:
                body = None
        self.error = body.get("error") if isinstance(body, dict) else None

    def data(self) -> Any:
        return self._data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

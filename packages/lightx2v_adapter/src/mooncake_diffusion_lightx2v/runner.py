"""The six DisaggMixin methods, done through core's DiffusionConnector.

``plugin.patch`` installs each of these in front of LightX2V's own method; they
run only for a runner whose config has ``disagg_config.transfer_backend ==
"mooncake_diffusion"``. Per runner, in the order LightX2V calls them:

    init_disagg(config)              WanRunner.init_modules(), once: connector + mailbox,
                                     and set_config wrapped (request_config.RoleConfig)
    send_encoder_outputs(inputs, latent_shape)   Encoder, per request
    receive_encoder_outputs() -> dict            Transformer, per request
    send_transformer_outputs(latents)            Transformer with a decoder, per request
    receive_transformer_outputs() -> Tensor      Decoder, per request
    release_disagg()                 at shutdown: closes both; idempotent

How a handle finds its consumer: LightX2V pairs sender and receiver by room
(``bootstrap_room``) and by order, one slot per room. Here the n-th payload of
a (phase, room) channel is published, and its handle posted to core's
``Mailbox`` (Mooncake Store) as ``<channel>/p<phase>/<room>/<n>``; the receiver's
n-th receive on that channel takes it from there. So n requests may be in
flight on one channel, and a sender never waits for its receiver to re-arm.
Both sides count from 0 when they start: restart all roles of a channel
together (as with LightX2V's rooms), or give restarted ones a new ``channel``.

Blocking: as LightX2V's own sends, a send returns only once the payload is
safe without the sender (store: in the store host; p2p, and ``auto``, which
picks p2p for LightX2V's named receivers: once the receiver has pulled the
bytes), up to ``timeout_s``; so a sender may exit right after its send. In p2p
a room's sender therefore waits for its receiver, one request at a time, as
LightX2V's own rooms do. Receives block until the payload has landed, up to
``timeout_s``.
Not thread-safe per runner (LightX2V calls a runner from one thread).

Queue mode (``disagg_config.queue``, see ``queue_mode.py``): ``init_disagg``
also starts a ``StageWorker`` for the role; the send/receive methods then act on
the orchestrator item being run (receive: consume its input handle; send: hand
the payload to the worker, which publishes it with lease ``retained``) instead
of on the mailbox rooms.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import time
import uuid
from typing import Any

import torch

from mooncake_diffusion import DiffusionConnector, StagePayload
from mooncake_diffusion.errors import DeadlineExceededError
from mooncake_diffusion.handoff.mailbox import Mailbox
from mooncake_diffusion_lightx2v import payloads
from mooncake_diffusion_lightx2v.config import AdapterConfig
from mooncake_diffusion_lightx2v.request_config import RoleConfig

__all__ = ["AdapterState", "lightx2v_device", "lightx2v_dtype"]

logger = logging.getLogger(__name__)

# What LightX2V's own init_disagg leaves on a runner, so that runner code reading
# these attributes (e.g. ``self._disagg_p2_sender is not None``) works unchanged.
_LIGHTX2V_ATTRS = (
    "_disagg_data_mgr",
    "_disagg_sender",
    "_disagg_receiver",
    "_disagg_p2_data_mgr",
    "_disagg_p2_sender",
    "_disagg_p2_receiver",
)


def lightx2v_device() -> Any:
    """LightX2V's ``AI_DEVICE``, read at call time (it is set at ``import lightx2v``,
    after plugins load); ``"cpu"`` without LightX2V."""
    try:
        device = importlib.import_module("lightx2v_platform.base.global_var").AI_DEVICE
    except ImportError:
        return "cpu"
    return device or "cpu"


def lightx2v_dtype() -> torch.dtype | None:
    """LightX2V's ``GET_DTYPE()`` (bf16 unless ``DTYPE=FP16``); ``None`` without it."""
    try:
        return importlib.import_module("lightx2v.utils.envs").GET_DTYPE()
    except ImportError:
        return None


_MAX_HANDLE = 64 << 10  # a handle is ~200 B plus its meta (at most 8 KiB)
_MAX_REMEMBERED = 4096  # p2p handle names kept for discard at release


class _Channel:
    """One direction of one phase, as a LightX2V attribute (``_disagg_sender`` etc.)
    would hold it; counts the payloads moved per room."""

    def __init__(self, phase: int, direction: str) -> None:
        self.phase = phase
        self.direction = direction
        self.sequence: dict[int, int] = {}

    def next_seq(self, room: int) -> int:
        seq = self.sequence.get(room, 0)
        self.sequence[room] = seq + 1
        return seq

    def __repr__(self) -> str:
        return f"<mooncake_diffusion Phase {self.phase} {self.direction}>"


class AdapterState:
    """What ``init_disagg`` attaches to a runner as ``_mcd``: the parsed config, one
    connector, one mailbox and the channels this role uses. ``close()`` ends it."""

    def __init__(self, cfg: AdapterConfig) -> None:
        self.cfg = cfg
        self.connector = DiffusionConnector(
            cfg.connector_role,
            cfg.transfer_mode,  # type: ignore[arg-type]
            cfg.settings,
            receive_pool_bytes=cfg.receive_pool_bytes,
            timeout_s=cfg.timeout_s,
        )
        try:
            self.mailbox = Mailbox(cfg.settings, max_record=_MAX_HANDLE)
        except BaseException:
            self.connector.close()
            raise
        #: mailbox names of p2p payloads posted here: useless once this process is gone
        self.posted_p2p: list[str] = []
        self.p1 = _Channel(1, "sender" if cfg.disagg_mode == "encoder" else "receiver")
        self.p2 = _Channel(2, "receiver" if cfg.disagg_mode == "decode" else "sender")
        #: how the last received payload came: ``path`` ("p2p/net", "p2p/shm",
        #: "store"), ``num_chunks``, ``nbytes`` (observability; tests read it)
        self.last_received: dict[str, Any] = {}
        self._closed = False
        #: queue mode: the role's StageWorker (``queue_mode.QueueRole``), else ``None``
        self.queue: Any = None
        #: the runner's own config, put back around each request (set by ``init_disagg``)
        self.role_config: RoleConfig | None = None
        # LightX2V (f8aee98b) never calls release_disagg: close at exit instead
        atexit.register(self.close)

    def publish(self, phase: int, room: int, payload_of: Any, stream_chunks: bool) -> None:
        """Publish one payload on (phase, room) and post its handle; returns once
        the payload is safe without this process (in the store, or taken by the
        receiver). ``payload_of(request_id)`` builds the payload.

        Keeps both sides' counts in step on failure: an error before the handle is
        posted gives the sequence number back (the next send reuses it); after it
        is posted (streamed latents), the payload is withdrawn and the handle left
        in place, so the receiver fails that one request and both move on.
        """
        channel = self.p1 if phase == 1 else self.p2
        seq = channel.next_seq(room)
        name = self.cfg.mailbox_name(phase, room, seq)
        posted = False
        pub = None
        try:
            request_id = f"lx2v-{self.cfg.channel}-p{phase}-{room}-{seq}-{uuid.uuid4().hex[:8]}"
            payload: StagePayload = payload_of(request_id)
            # auto: every LightX2V channel has one named receiver, started before its sender
            pub = self.connector.publish(payload, consumer=f"{self.cfg.channel}/p{phase}/{room}")
            if stream_chunks:  # the receiver may start on chunk 0 while the rest moves
                self.mailbox.post(name, pub.encode())
                posted = True
                pub.wait(self.cfg.timeout_s)
            else:  # nothing to overlap: post only what is sure to be there
                pub.wait(self.cfg.timeout_s)
                self.mailbox.post(name, pub.encode())
                posted = True
            # return only once the payload no longer needs this process (p2p: taken)
            pub.wait_delivered(self.cfg.timeout_s)
        except BaseException:
            if pub is not None:
                pub.release()
            if not posted:
                channel.sequence[room] -= 1
            raise
        finally:
            if posted and pub is not None and pub.handle.transport == "p2p":
                self.posted_p2p.append(name)  # discarded at close if still untaken
                del self.posted_p2p[:-_MAX_REMEMBERED]

    def take(self, phase: int, room: int) -> bytes:
        """The next handle of (phase, room), waiting up to ``timeout_s``."""
        channel = self.p1 if phase == 1 else self.p2
        name = self.cfg.mailbox_name(phase, room, channel.next_seq(room))
        handle = self.mailbox.take_until(name, time.monotonic() + self.cfg.timeout_s)
        if handle is None:
            channel.sequence[room] -= 1  # nothing taken: the next call waits for it again
            raise DeadlineExceededError(
                f"[Disagg] no Phase {phase} payload on room {room} within "
                f"{self.cfg.timeout_s}s (mailbox {name!r})"
            )
        return handle

    def received(self, got: Any) -> None:
        """Record how ``got`` (a ``ReceivedPayload`` whose chunks all landed) came."""
        got.wait()  # a chunked fetch sets its path just after the last chunk lands
        self.last_received = {
            "path": got.path,
            "num_chunks": got.num_chunks,
            "nbytes": sum(t.nbytes for t in got.handle.tensors),
        }

    def fetch_phase1(self, config: Any, handle: bytes, connector: Any = None) -> dict:
        """Consume a Phase 1 payload into LightX2V's dict (tensors copied to ``AI_DEVICE``),
        through ``connector`` (default this role's; queue mode: the item's watched one,
        so a lost input is reported as lost)."""
        dtype = lightx2v_dtype() or torch.bfloat16
        with (connector or self.connector).consume(handle) as got:
            meta = got.meta
            if "crc32" in meta:
                payloads.verify(got.tensors, meta["crc32"])
            self.received(got)
            return payloads.unpack_phase1(config, got.tensors, meta, dtype, lightx2v_device())

    def fetch_phase2(self, handle: bytes, connector: Any = None) -> tuple[torch.Tensor, dict]:
        """Consume a Phase 2 payload: the latents on ``AI_DEVICE`` (each temporal chunk
        copied there as it lands) and their meta; ``connector`` as in ``fetch_phase1``."""
        with (connector or self.connector).consume(handle) as got:
            spec = got.handle.tensors[0]
            out = torch.empty(
                spec.shape, dtype=getattr(torch, spec.dtype), device=lightx2v_device()
            )
            dim = got.handle.chunk_dim
            start = 0
            for chunk in got:
                part = chunk.tensor
                if dim is None:
                    out.copy_(part)
                else:
                    out.narrow(dim, start, part.shape[dim]).copy_(part)
                    start += part.shape[dim]
            meta = got.meta
            if "crc32" in meta:
                payloads.verify(got.tensors, meta["crc32"])
            self.received(got)
        return out, meta

    def close(self) -> None:
        """Discard the handles of p2p payloads nobody took (their bytes die with the
        connector), then close mailbox and connector. Store payloads and their
        handles stay for their receivers (until ``ttl_s``). Idempotent; also runs
        at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self.queue is not None:
                self.queue.close()
            for name in self.posted_p2p:
                self.mailbox.discard(name)
            self.posted_p2p.clear()
            self.mailbox.close()
        finally:
            self.connector.close()


# --------------------------------------------------------------------------- #
#  The methods (``self`` is a LightX2V runner)
# --------------------------------------------------------------------------- #


def init_disagg(self: Any, config: Any) -> None:
    """Parse ``disagg_config``, connect to the Mooncake master (fails fast with
    ``MasterUnavailableError`` when it is not there) and set LightX2V's attributes."""
    cfg = AdapterConfig.from_runner_config(config)
    state = AdapterState(cfg)
    state.role_config = RoleConfig(self)
    if cfg.queue is not None:
        from mooncake_diffusion_lightx2v.queue_mode import QueueRole

        try:
            state.queue = QueueRole(self, state)
        except BaseException:
            state.close()
            raise
    self._mcd = state
    # a request's settings (and rooms) end with the request: RoleConfig's docstring
    state.role_config.install()
    self._disagg_mode = cfg.disagg_mode
    self._disagg_cfg = config.get("disagg_config", {})
    self._disagg_decentralized = False
    self._disagg_bootstrap_room = cfg.room(config, 1)
    self._disagg_rdma_buffers = []
    self._disagg_p2_rdma_buffers = []
    for attr in _LIGHTX2V_ATTRS:
        setattr(self, attr, None)
    if cfg.disagg_mode == "encoder":
        self._disagg_sender = state.p1
    elif cfg.disagg_mode == "transformer":
        self._disagg_receiver = state.p1
        if cfg.sends_phase2:
            self._disagg_p2_sender = state.p2
    else:
        self._disagg_p2_receiver = state.p2
    logger.info(
        "[Disagg] mooncake_diffusion %s: master %s, transfer_mode %s, %s",
        cfg.disagg_mode,
        cfg.settings.master,
        cfg.transfer_mode,
        f"channel {cfg.channel!r}" if cfg.queue is None else "queue mode",
    )


def _state(self: Any, what: str) -> AdapterState:
    state = getattr(self, "_mcd", None)
    if state is None:
        raise RuntimeError(f"[Disagg] {what}: init_disagg was not called (or released)")
    return state


def _item_input(current: Any) -> bytes:
    handle = current.item.input
    if not handle:
        raise ValueError(f"[Disagg] {current.item.stage}: the orchestrator item has no input")
    return handle


def send_encoder_outputs(self: Any, inputs: dict, latent_shape: list) -> None:
    """Publish the encoder outputs of one request (Phase 1)."""
    state = _state(self, "send_encoder_outputs")
    tensors, meta = payloads.pack_phase1(self.config, inputs, latent_shape, lightx2v_dtype())
    if state.cfg.verify:
        meta["crc32"] = payloads.checksums(tensors)
    if state.queue is not None:
        current = state.queue.current("send_encoder_outputs")
        current.output = StagePayload(
            request_id=current.item.request_id,
            kind="embedding",
            tensors=tensors,
            meta=meta,
            lease="retained",
        )
        return
    state.publish(
        1,
        state.cfg.room(self.config, 1),
        lambda rid: StagePayload(
            request_id=rid, kind="embedding", tensors=tensors, meta=meta, ttl_s=state.cfg.ttl_s
        ),
        stream_chunks=False,
    )


def receive_encoder_outputs(self: Any) -> dict:
    """Wait for the next Phase 1 payload; LightX2V's dict, tensors on ``AI_DEVICE``."""
    state = _state(self, "receive_encoder_outputs")
    if state.queue is not None:
        current = state.queue.current("receive_encoder_outputs")
        if current.prefetched is None:
            current.prefetched = state.fetch_phase1(
                self.config, _item_input(current), current.ctx.connector
            )
        got, current.prefetched = current.prefetched, None
        return got
    return state.fetch_phase1(self.config, state.take(1, state.cfg.room(self.config, 1)))


def send_transformer_outputs(self: Any, latents: torch.Tensor) -> None:
    """Publish one request's latents (Phase 2), in temporal chunks."""
    state = _state(self, "send_transformer_outputs")
    if getattr(self, "_disagg_p2_sender", None) is None:
        raise RuntimeError(
            "[Disagg] Phase2 sender is not initialized. Check decoder_engine_rank in disagg_config."
        )
    out = payloads.pack_phase2(latents, lightx2v_dtype())
    meta = payloads.phase2_meta(out, getattr(self, "input_info", None))
    if state.cfg.verify:
        meta["crc32"] = payloads.checksums({"latents": out})
    chunk_dim = out.dim() - 3 if out.dim() >= 4 else None  # T of [C, T, H, W] / [B, C, T, H, W]
    chunks = min(state.cfg.latent_chunks, out.shape[chunk_dim]) if chunk_dim is not None else 1
    if state.queue is not None:
        current = state.queue.current("send_transformer_outputs")
        current.output = StagePayload(
            request_id=current.item.request_id,
            kind="latent",
            tensors={"latents": out},
            meta=meta,
            chunk_dim=chunk_dim if chunks > 1 else None,
            num_chunks=chunks,
            lease="retained",
        )
        return
    state.publish(
        2,
        state.cfg.room(self.config, 2),
        lambda rid: StagePayload(
            request_id=rid,
            kind="latent",
            tensors={"latents": out},
            meta=meta,
            chunk_dim=chunk_dim if chunks > 1 else None,
            num_chunks=chunks,
            ttl_s=state.cfg.ttl_s,
        ),
        stream_chunks=chunks > 1,
    )


def receive_transformer_outputs(self: Any) -> torch.Tensor:
    """Wait for the next Phase 2 payload; the latents on ``AI_DEVICE``, each
    temporal chunk copied there as soon as it lands. Sets ``_p2_receive_meta``."""
    state = _state(self, "receive_transformer_outputs")
    if state.queue is not None:
        current = state.queue.current("receive_transformer_outputs")
        if current.prefetched is None:
            current.prefetched = state.fetch_phase2(_item_input(current), current.ctx.connector)
        (out, meta), current.prefetched = current.prefetched, None
    else:
        out, meta = state.fetch_phase2(state.take(2, state.cfg.room(self.config, 2)))
    self._p2_receive_meta = meta
    return out


def release_disagg(self: Any) -> None:
    """Close the connector and mailbox (withdrawing p2p payloads still held here).
    Idempotent."""
    state = getattr(self, "_mcd", None)
    self._mcd = None
    for attr in _LIGHTX2V_ATTRS:
        setattr(self, attr, None)
    if state is not None:
        state.close()

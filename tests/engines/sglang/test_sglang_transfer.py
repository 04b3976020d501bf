"""sglang's own diffusion transfer manager, moving a request across processes
through the adapter's engine, and the adapter's errors.

The receiver (a denoiser) is this process, the sender (an encoder) a child
process (``role_process.py``); both build sglang's transfer path with sglang's
classes through sglang's factory. No sglang class is substituted: with the
adapter selected, sglang's ``TransferTensorBuffer`` gets a shared host pool
(memfd) instead of CUDA pinned memory, so it runs on this CPU-only machine as
it is. Same host: the sender copies into the receiver's pool directly
(``shm``); with ``--mooncake-diffusion-same-host off`` the bytes go through
the Mooncake Transfer Engine over loopback TCP (``net``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest
from mooncake_diffusion_sglang.options import BACKEND
from role_process import FIELDS, make_fields, start_role

from helpers import same_bytes
from mooncake_diffusion import MooncakeSettings
from mooncake_diffusion.handoff.direct import _pools
from mooncake_diffusion.platform.childproc import JsonLinesChild
from mooncake_diffusion.testing import assert_no_leaks

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("clean_env")]

SENDER = [sys.executable, os.path.join(os.path.dirname(__file__), "role_process.py")]
SLOT = 16 << 20


def _sender(sgl_model: str, *extra: str) -> JsonLinesChild:
    child = JsonLinesChild(SENDER, MooncakeSettings(), "sglang sender")
    reply = child.request(op="setup", model=sgl_model, extra=list(extra))
    assert reply["ok"] and reply["engine"] == "MooncakeDiffusionTransferEngine", reply
    return child


@pytest.mark.parametrize(("same_host", "path"), [("auto", "shm"), ("off", "net")])
def test_transfer_manager_moves_a_request_byte_identical(
    sgl_model: str, same_host: str, path: str
) -> None:
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    flags = ["--disagg-transfer-backend", BACKEND, "--mooncake-diffusion-same-host", same_host]
    recv = start_role(sgl_model, "denoiser", *flags)
    assert recv.buffer.pool_data_ptr in _pools  # the shared host pool, not CUDA memory
    with _sender(sgl_model, *flags) as sender:
        for i in range(2):  # two requests through the same slot
            rid = f"req-{same_host}-{i}"
            pending = recv.manager.allocate_receive_slot(rid, SLOT)
            assert pending is not None
            addr = recv.manager.pool_data_ptr + pending.slot.offset
            got = sender.request(
                op="stage_push", request_id=rid, session=recv.engine.session_id, addr=addr
            )
            assert got["pushed"], got
            assert got["fields"] == sorted(FIELDS)
            assert got["by_path"][path] == i + 1, got["by_path"]
            tensors, event = recv.manager.load_tensors_async(rid, got["manifest"], device="cpu")
            assert event is None  # CPU: nothing asynchronous
            want = make_fields()
            assert sorted(tensors) == sorted(want)
            for name, expected in want.items():
                loaded = tensors[name] if isinstance(tensors[name], list) else [tensors[name]]
                assert len(loaded) == len(expected)
                assert all(same_bytes(a, b) for a, b in zip(loaded, expected, strict=True)), name
            recv.manager.free_receive_slot(rid)
        assert sender.request(op="close")["ok"]
    recv.close()
    assert recv.engine.stats().registered == 0
    del recv
    assert_no_leaks(None, threads)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_errors_are_clear_and_leave_the_engine_working(sgl_model: str) -> None:
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    flags = ["--disagg-transfer-backend", BACKEND, "--mooncake-diffusion-retries", "2"]
    recv = start_role(sgl_model, "denoiser", *flags)
    send = start_role(sgl_model, "encoder", *flags)  # a second engine, this process
    src = send.buffer.pool_data_ptr
    dst = recv.buffer.pool_data_ptr
    session = recv.engine.session_id
    engine = send.engine
    logged = _Records()  # sglang configures logging itself; listen on the adapter's logger
    logger = logging.getLogger("mooncake_diffusion_sglang.engine")
    logger.addHandler(logged)

    # an unreachable peer session: nothing listens there
    assert engine.transfer_sync("127.0.0.1:1", src, dst, 4096) == -3
    assert "127.0.0.1:1 is unreachable" in str(engine.last_error)
    assert any("(-3): peer 127.0.0.1:1 is unreachable" in line for line in logged.lines)

    # a destination outside the receiver's registered memory, refused before sending
    outside = dst + recv.buffer.pool_size
    assert engine.transfer_sync(session, src, outside, 4096) == -2
    assert "outside the memory peer" in str(engine.last_error)
    # ... and over the network, where the receiving Transfer Engine refuses it
    segment = session.split("|", 1)[0]
    assert engine.transfer_sync(segment, src, outside, 4096) == -1
    assert "refused" in str(engine.last_error) and "registered" in str(engine.last_error)

    # a malformed session string
    assert engine.transfer_sync("not-a-session", src, dst, 4096) == -1
    assert "malformed peer session" in str(engine.last_error)

    # after all that, a good write still lands (shm path: same host)
    send.buffer._pool[:4096] = 7
    assert engine.transfer_sync(session, src, dst, 4096) == 0
    assert bool((recv.buffer._pool[:4096] == 7).all())
    logger.removeHandler(logged)
    assert len(logged.lines) == 4  # each failure logged once, with its reason
    stats = engine.stats()
    assert stats.failures == 4 and stats.writes == 1 and stats.retries >= 2
    send.close()
    recv.close()
    del send, recv
    assert_no_leaks(None, threads)

"""The real ``sglang serve`` deployment: a ``--disagg-role server`` head and one
encoder, denoiser and decoder process, each started through sglang's CLI and
spawning its scheduler through sglang's worker bootstrap, with
``--disagg-transfer-backend mooncake-diffusion``.

Real: sglang's CLI, plugin loading, worker bootstrap, ``Scheduler`` and its
disaggregation mixin (push and prefetch threads), ``DiffusionServer`` (credits,
``__transfer__`` messages, pre-allocated and allocated receive slots, whole-slot
pushes: ``data_size`` is the buddy slot's size), ``TransferTensorBuffer`` and
``DiffusionTransferManager``, the adapter and core's ``DirectEngine`` over the
Mooncake Transfer Engine (loopback TCP) or the same-host path.

Replaced, by a test-only sglang plugin (``fake_worker/``, loaded through
sglang's own plugin discovery in those processes only):
- the model worker (``CPUWorker``): no Wan 2.1 weights here, and a real
  forward pass takes minutes on CPU. The fake produces tensors of the real
  shapes and dtypes and records the SHA-256 of everything it received and sent;
- ``torch.get_device_module()`` without a device answers ``torch.cpu``: sglang
  takes its transfer stream and events from it, and its CUDA-build torch
  would hand out ``torch.cuda.Stream``, which refuses a CPU device.

The encoder pushes over the same-host path (``shm``), the denoiser over the
Transfer Engine (the decoder runs with ``--mooncake-diffusion-same-host off``,
so its session offers senders no same-host path): both paths, with
small and 68 MB latents. No Mooncake master or store: sglang's transfer path
moves bytes peer to peer only. The processes start once for the module (sglang
imports take minutes on a busy machine); the fault tests run last, in order:
stopped receivers, then the decoder killed, then the decoder started again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time

import pytest
from serve_stack import FAKE, ROLES, ServeStack

from mooncake_diffusion.memory.samehost import process_stopped
from mooncake_diffusion.testing import assert_no_leaks

# one deployment for the module: its start-up (minutes of sglang imports) counts
# against the first test, so the hang guard is wider than the suite default
pytestmark = [pytest.mark.engines, pytest.mark.timeout(1800)]

WAIT_MAX_S = 900.0  # hang guard for the gate and the client (never a measured bound)
#: the decoder offers senders no same-host path; the encoder's staging pool holds
#: one 128 MiB slot (the large request's) or eight 16 MiB ones (a small request's),
#: so staging slots its failed pushes kept would soon leave no room for a 64 MiB
#: one; its same-host pushes to a stopped receiver end after 10 s
ROLE_FLAGS = {
    "decoder": ["--mooncake-diffusion-same-host", "off"],
    "encoder": [
        "--disagg-transfer-pool-size",
        str(128 << 20),
        "--mooncake-diffusion-timeout",
        "10",
    ],
}


def _fake():
    """The fake worker's module, for its tensor recipes; loaded from its file so
    that its folder (and its entry point) never lands on this process's path."""
    spec = importlib.util.spec_from_file_location("_mcd_fake", FAKE / "mcd_sglang_fake_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake = _fake()


@pytest.fixture(scope="module")
def stack(sgl_model: str, tmp_path_factory: pytest.TempPathFactory):
    threads = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    root = tmp_path_factory.mktemp("sglang-roles")
    st = ServeStack(sgl_model, root, roles=ROLE_FLAGS)
    pids: set[int] = set()
    try:
        st.start()
        pids.update(st.scheduler_pid(r) for r in ROLES)
        yield st
        pids.update(st.scheduler_pid(r) for r in ROLES)  # a role may have restarted
    finally:
        st.close()
    # nothing left: every sglang process (heads, roles and their schedulers) is gone,
    # and with them their Transfer Engines, registrations and memfd pools
    assert all(p.poll() is not None for p in st.procs.values())
    for pid in pids:  # SIGKILLed by close(); its exit is asynchronous, so wait (bounded)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"scheduler {pid} outlived its deployment"
    assert_no_leaks(None, threads)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_stopped(pid: int, role: str, deadline: float) -> None:
    """Wait until ``pid`` is stopped (a SIGSTOP is delivered asynchronously)."""
    while not process_stopped(pid):
        assert time.monotonic() < deadline, f"the {role} did not stop"
        time.sleep(0.01)


def _client(stack: ServeStack, prompt: str, rid: str) -> tuple[threading.Thread, dict]:
    """Send ``prompt`` from a started client thread; its answer lands in the dict
    (``out``). A daemon: it never keeps the test process alive (a dead head never
    answers)."""
    answer: dict = {}
    client = threading.Thread(
        target=lambda: answer.update(out=stack.generate(prompt, rid)), name="client", daemon=True
    )
    client.start()
    return client, answer


def _held_at_the_denoiser(
    stack: ServeStack, prompt: str, rid: str
) -> tuple[threading.Thread, dict, float]:
    """Send ``prompt`` (it must say ``hold``) from a client thread and wait until the
    denoiser holds it at its gate. Returns the thread, the dict its answer lands in
    (``out``) and the hang guard's deadline."""
    client, answer = _client(stack, prompt, rid)
    reached = stack.fake_dir / f"{rid}.reached"
    deadline = time.monotonic() + WAIT_MAX_S
    while not reached.exists():
        assert time.monotonic() < deadline, "the denoiser never reached the gate"
        time.sleep(0.05)
    return client, answer, deadline


def _records(stack: ServeStack, rid: str, kind: str = "") -> dict[str, dict]:
    out = {}
    for role in ROLES:
        path = stack.fake_dir / f"{rid}.{role}{kind}.json"
        if path.exists():
            out[role] = json.loads(path.read_text())
    return out


def _sent_no_pushed(stack: ServeStack, role: str, rid: str) -> None:
    """The failed push of ``rid`` raised out of ``push_to_peer`` (the adapter's hook),
    so sglang's push thread sent the server no ``transfer_pushed``, which would race
    the error report: the thread logs "RDMA push failed" only after sending one
    (sglang's manager logs a line like it inside the push: not this one)."""
    thread = f"Transfer {role.upper()}: RDMA push"
    # the client may have its answer before the push thread logs: wait for the line
    deadline = time.monotonic() + WAIT_MAX_S
    while f"{thread} thread error for {rid}" not in (log := stack.log(role)):
        assert time.monotonic() < deadline, log[-4000:]
        time.sleep(0.05)
    # raised by the adapter's hook, not by anything else in the push thread
    assert f"PushFailedError: mooncake-diffusion push of {rid} " in log, log[-4000:]
    assert f"{thread} failed for {rid}" not in log


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_request_crosses_every_hop_byte_identical(stack: ServeStack, size: str) -> None:
    rid = f"bytes-{size}"
    out = stack.generate(f"{size} a red fox in snow", rid)
    assert out.error is None, out.error
    # what the encoder must produce and the denoiser must return, computed here
    produced = fake.encoder_outputs(rid, size)
    want = {name: fake.digest(value) for name, value in produced.items()}
    latents = fake.denoised(produced["latents"])
    seen = _records(stack, rid)
    assert seen["encoder"]["sent"] == want
    # hop 1, encoder -> denoiser: every field, byte for byte (same-host path)
    assert seen["denoiser"]["received"] == want
    assert seen["denoiser"]["sent"] == {"latents": fake.digest(latents)}
    # hop 2, denoiser -> decoder (Transfer Engine): the new latents and the rest
    assert seen["decoder"]["received"] == {**want, "latents": fake.digest(latents)}
    # hop 3, decoder -> DiffusionServer -> client: the digest the decoder computed
    assert bytes(out.output.tolist()) == bytes.fromhex(fake.digest(latents))
    pushes = _records(stack, rid, ".push")
    assert sorted(pushes) == ["denoiser", "encoder"]
    assert all(p["ok"] for p in pushes.values())
    # the path each sender took, from the adapter engine's own counters
    encoder, denoiser = pushes["encoder"]["by_path"], pushes["denoiser"]["by_path"]
    assert encoder["shm"] >= 1 and encoder["net"] == 0, pushes
    assert denoiser["net"] >= 1 and denoiser["shm"] == 0, pushes
    # whole buddy slots move: at least the payload, a power of two
    payload = produced["latents"].nbytes
    for p in pushes.values():
        assert p["size"] >= payload and p["size"] & (p["size"] - 1) == 0, p


def test_a_stopped_same_host_receiver_fails_the_request_within_timeout_s(
    stack: ServeStack,
) -> None:
    """The denoiser's scheduler SIGSTOPped: the encoder's same-host push copies into
    its pool, but nobody reads it. The request fails with that reason once the
    encoder's ``timeout_s`` (10 s here) has passed, not after ``--disagg-timeout``
    (a day here). The denoiser runs again afterwards."""
    rid = "stopped-1"
    victim = stack.scheduler_pid("denoiser")
    os.kill(victim, signal.SIGSTOP)
    try:
        _wait_stopped(victim, "denoiser", time.monotonic() + WAIT_MAX_S)
        client, answer = _client(stack, "small stopped", rid)
        client.join(WAIT_MAX_S)
        assert not client.is_alive(), "the client is still waiting"
    finally:
        os.kill(victim, signal.SIGCONT)
    error = answer["out"].error
    assert error, "the request did not fail"
    assert "DiffusionServer timeout" not in error
    assert error.startswith(f"encoder error: mooncake-diffusion push of {rid} "), error
    assert "is stopped" in error, error
    _sent_no_pushed(stack, "encoder", rid)


def test_a_network_push_cut_off_by_a_stopped_receiver_keeps_its_slot_out_of_use(
    stack: ServeStack,
) -> None:
    """The decoder's scheduler SIGSTOPped while the denoiser holds a request (gate
    file) with 44 MB latents (with the text, a pre-allocated receive slot's worth);
    released, the denoiser's network push cannot complete (more than loopback's
    socket buffers hold) and ends by the adapter's ``timeout_s``, in flight or
    reported failed by Mooncake, which cannot cancel it (and whose failure is no
    proof that the rest will not land once the decoder reads again). So the head
    must not hand that slot to another request (sglang would; the adapter's hook
    keeps it out of use and says so). The request fails with the reason; the decoder
    serves the next request byte for byte."""
    rid = "cutoff-1"
    client, answer, deadline = _held_at_the_denoiser(stack, "medium hold cutoff", rid)
    victim = stack.scheduler_pid("decoder")
    os.kill(victim, signal.SIGSTOP)
    try:
        _wait_stopped(victim, "decoder", deadline)
        (stack.fake_dir / f"{rid}.released").write_text("")
        client.join(WAIT_MAX_S)
        assert not client.is_alive(), "the client is still waiting"
    finally:
        os.kill(victim, signal.SIGCONT)
    error = answer["out"].error
    assert error, "the request did not fail"
    assert "DiffusionServer timeout" not in error
    assert error.startswith(f"denoiser error: mooncake-diffusion push of {rid} "), error
    # in flight at the deadline, failed and then past it, or failed on every attempt
    assert "deadline" in error or "refused" in error, error
    _sent_no_pushed(stack, "denoiser", rid)
    kept = [line for line in stack.log("head").splitlines() if "stays out of use" in line]
    assert len(kept) == 1 and rid in kept[0], kept
    after = "after-cutoff-1"
    out = stack.generate("small after cutoff", after)
    assert not out.error, out.error
    got = _records(stack, after)
    assert got["decoder"]["received"]["latents"] == got["denoiser"]["sent"]["latents"]


def test_failed_pushes_to_a_stopped_receiver_free_their_staging_slots(
    stack: ServeStack,
) -> None:
    """The denoiser's scheduler SIGSTOPped, five small requests in a row: each fails
    with the reason (its receiver is stopped). The same-host copy of each ran in the
    encoder's push thread and ended before the push failed, so nothing can read its
    staging slot any more and the adapter frees it (sglang frees a slot only after
    a push that landed). Kept, the six 16 MiB slots of these and the first stopped
    request would leave the encoder's 128 MiB pool no 64 MiB slot: after SIGCONT, a
    request with 32 MiB latents must still cross every hop byte for byte, with only
    its own staging slot held at the encoder."""
    victim = stack.scheduler_pid("denoiser")
    os.kill(victim, signal.SIGSTOP)
    try:
        _wait_stopped(victim, "denoiser", time.monotonic() + WAIT_MAX_S)
        for i in range(5):
            rid = f"stalled-{i}"
            client, answer = _client(stack, "small stalled", rid)
            client.join(WAIT_MAX_S)
            assert not client.is_alive(), f"request {i} is still waiting"
            error = answer["out"].error
            assert error, f"request {i} did not fail"
            assert error.startswith(f"encoder error: mooncake-diffusion push of {rid} "), error
            assert "is stopped" in error, error
            _sent_no_pushed(stack, "encoder", rid)
    finally:
        os.kill(victim, signal.SIGCONT)
    rid = "after-stalls"
    out = stack.generate("mid after stalls", rid)
    assert out.error is None, out.error
    produced = fake.encoder_outputs(rid, "mid")
    seen = _records(stack, rid)
    assert seen["denoiser"]["received"] == {n: fake.digest(v) for n, v in produced.items()}
    assert seen["decoder"]["received"]["latents"] == seen["denoiser"]["sent"]["latents"]
    # no staging slot of a failed push is left at the encoder (the leak check)
    assert _records(stack, rid, ".push")["encoder"]["staged"] == [rid]


def test_a_killed_decoder_fails_the_request_with_its_reason(stack: ServeStack) -> None:
    """The denoiser holds the request (gate file) while the decoder's scheduler is
    SIGKILLed; then the push to the dead decoder fails. The client must get that
    failure with its reason from the failure path: ``--disagg-timeout`` is a day,
    so an answer can only come from there (no timing is asserted)."""
    rid = "held-1"
    client, answer, deadline = _held_at_the_denoiser(stack, "small hold", rid)
    victim = stack.scheduler_pid("decoder")
    stack.kill_scheduler("decoder")
    while _alive(victim):
        assert time.monotonic() < deadline, "the decoder did not die"
        time.sleep(0.05)
    (stack.fake_dir / f"{rid}.released").write_text("")
    client.join(WAIT_MAX_S)
    assert not client.is_alive(), "the client is still waiting"
    error = answer["out"].error
    assert error, "the request did not fail"
    assert "DiffusionServer timeout" not in error
    assert error.startswith("denoiser error: mooncake-diffusion push of held-1 to 127.0.0.1:")
    assert "unreachable" in error or "is gone" in error, error
    push = _records(stack, rid, ".push")["denoiser"]
    assert push["ok"] is False
    _sent_no_pushed(stack, "denoiser", rid)
    assert "decoder" not in _records(stack, rid)  # nothing reached a decoder


def test_every_request_to_a_dead_decoder_fails_with_the_reason(stack: ServeStack) -> None:
    """After the decoder died (the test above), five requests in a row: each fails with
    the reason its receiver is gone, none waits for a receive slot the dead decoder
    would have to grant (sglang's slow path, answered by nobody until
    ``--disagg-timeout``, a day here). Before, only as many as the decoder had free
    pre-allocated slots failed; sglang never returned them to the receiver."""
    assert not _alive(stack.scheduler_pid("decoder")), "run after the decoder was killed"
    for i in range(5):
        rid = f"after-death-{i}"
        client, answer = _client(stack, "small after", rid)
        client.join(WAIT_MAX_S)
        assert not client.is_alive(), f"request {i} is still waiting"
        error = answer["out"].error
        assert error, f"request {i} did not fail"
        assert "DiffusionServer timeout" not in error
        assert error.startswith(f"denoiser error: mooncake-diffusion push of {rid} "), error
        assert "unreachable" in error or "is gone" in error, error
        assert "decoder" not in _records(stack, rid)
        _sent_no_pushed(stack, "denoiser", rid)
    # the server marked the decoder's session dead (the adapter's hook in its process)
    assert "is gone; no more requests go to it" in stack.log("head")


def test_a_restarted_decoder_serves_and_its_dead_session_is_forgotten(
    stack: ServeStack,
) -> None:
    """After the decoder died (the tests above), its role starts again: a new
    scheduler registers a new session with the head in the dead one's place. The
    head then forgets the dead session (it keeps none per receiver that restarted,
    not every dead one for ever), and the next request crosses every hop to the new
    decoder byte for byte."""
    old = stack.scheduler_pid("decoder")
    assert not _alive(old), "run after the decoder was killed"
    gone = [line for line in stack.log("head").splitlines() if "is gone; no more" in line]
    assert len(gone) == 1, gone
    dead_segment = gone[0].split("(session ", 1)[1].split(")", 1)[0]
    stack.restart("decoder")
    assert stack.scheduler_pid("decoder") != old
    # the head has the new session before a request is dispatched to it (the
    # registration travels on the decoder's own socket, in no fixed order with them)
    registered = "DiffusionServer transfer: registered RoleType.DECODER[0]"
    deadline = time.monotonic() + WAIT_MAX_S
    while stack.log("head").count(registered) < 2:
        assert time.monotonic() < deadline, "the restarted decoder never registered"
        time.sleep(0.05)
    rid = "after-restart"
    out = stack.generate("small after restart", rid)
    assert out.error is None, out.error
    seen = _records(stack, rid)
    assert seen["decoder"]["received"]["latents"] == seen["denoiser"]["sent"]["latents"]
    assert bytes(out.output.tolist()) == bytes.fromhex(seen["denoiser"]["sent"]["latents"])
    forgotten = [
        line for line in stack.log("head").splitlines() if "of a dead receiver forgotten" in line
    ]
    assert len(forgotten) == 1 and f"session {dead_segment} " in forgotten[0], forgotten

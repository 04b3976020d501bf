"""MammothModa2 (AR -> DiT) served by NVIDIA Dynamo 1.6.1 with MooncakeDiffusionConnector.

The client is the official ``openai`` SDK on Dynamo's frontend
(``POST /v1/images/generations``); the router (``--omni-router``) and both stage
workers are Dynamo's own code, the models are stubs (``dyn_stub.py``), and the
AR -> DiT payload (vLLM-Omni's ``OmniRequestOutput`` with its bf16 latent) moves
through our connector in store mode on a real Mooncake cluster. Two routers serve
the same stage workers: ``router`` (MODEL_NAME) as installed, and ``router_reclaim``
(RECLAIM_MODEL_NAME) with the adapter's opt-in reclaim hook on
(``MOONCAKE_DIFFUSION_DYNAMO_RECLAIM=1``, ``mooncake_diffusion_vllm_omni/dynamo.py``).
What each test checks is in its docstring; each ends with the store empty.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time

import openai
import pytest
from conftest import MODEL_NAME, RECLAIM_MODEL_NAME
from dyn_stub import GENERATED, colour, latent, prompt_ids

# The module's deployment starts inside the first test, so pytest-timeout's hang
# guard (300 s by default) is widened to cover START_TIMEOUT_S as well.
pytestmark = [pytest.mark.engines, pytest.mark.timeout(3000)]

SIZE = (64, 48)  # width, height
REQUEST_TIMEOUT_S = 600.0  # a bound on a hung call, not a measure
RECLAIM_BOUND_S = 5.0  # what the hook promises: a failed request's keys gone by then
HOOK_ON = "MOONCAKE_DIFFUSION_DYNAMO_RECLAIM is on"
RECLAIMED = re.compile(r"failed request (\S+) \((.*)\): reclaimed its payloads")


def _client(stack) -> openai.OpenAI:
    # max_retries=0: what the first attempt gets is what is asserted
    return openai.OpenAI(
        base_url=stack.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


def _expected_colour(prompt: str) -> tuple[int, int, int]:
    ids = prompt_ids(prompt)
    generated = [(sum(ids) + i) % 1000 for i in range(GENERATED)]
    # ar2diffusion: prompt ids + all generated ids but the last
    return colour(latent(prompt), ids + generated[:-1])


def _generate(client: openai.OpenAI, prompt: str, model: str = MODEL_NAME):
    return client.images.generate(
        model=model, prompt=prompt, size=f"{SIZE[0]}x{SIZE[1]}", response_format="b64_json"
    )


def _reclaimed(stack, after: int) -> re.Match[str]:
    """The first reclaim line the reclaiming router logged after its first ``after``
    lines. The client may have its error before the router's output is read here:
    polled, bounded by REQUEST_TIMEOUT_S."""
    proc = stack.procs["router_reclaim"]
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        for line in proc.lines[after:]:
            if m := RECLAIMED.search(line):
                return m
        assert time.monotonic() < deadline, "router_reclaim logged no reclaim"
        time.sleep(0.01)


def test_image_generation_through_dynamo(dynamo_stack, mooncake_cluster):
    """200 with a PNG of the requested size whose every pixel is the digest of the
    exact latent stage 0 produced: the payload crossed the 0 -> 1 edge intact, as the
    types MammothModa2's ``ar2diffusion`` reads (``.outputs``, ``.prompt_token_ids``).
    Every process that built a connector built ours, the router included (it never
    parses vLLM's arguments: the registration hook did it), and no key is left."""
    from PIL import Image

    prompt = "a lighthouse on a cliff at dusk"
    with _client(dynamo_stack) as client:
        resp = _generate(client, prompt)
    assert len(resp.data) == 1
    image = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert image.format == "PNG"
    assert image.size == SIZE
    assert image.convert("RGB").getcolors() == [(SIZE[0] * SIZE[1], _expected_colour(prompt))]

    for name in ("router", "stage0", "stage1"):
        out = dynamo_stack.output(name)
        assert "Created connector: MooncakeDiffusionConnector" in out, name
    assert mooncake_cluster.keys() == []


def test_reclaim_hook_on_a_stage_error_chunk(dynamo_stack, mooncake_cluster):
    """With the hook on, a stage that answers with an error chunk has the request
    reclaimed. Stage 1's stub engine raises as armed (``fail``), after Dynamo's
    stage worker took the payload (``connector.get``) and ran ``ar2diffusion``, so
    the worker streams ``{"error": ...}`` to the router, which passes it on (a bare
    500 from Dynamo 1.6.1's frontend). The hook saw the chunk: the
    reclaiming router logs the reclaim of the very request id stage 1 failed. The
    store held nothing of it to reclaim (stage 1 had consumed the payload), and
    nothing is left."""
    stack = dynamo_stack
    assert stack.procs["stage1"].popen.poll() is None, "stage 1 must be up"
    after = len(stack.procs["router_reclaim"].lines)
    (stack.gate / "fail").touch()
    with _client(stack) as client, pytest.raises(openai.APIStatusError) as failed:
        _generate(client, "a heron in the reeds", model=RECLAIM_MODEL_NAME)
    # observed with Dynamo 1.6.1, hook on or off: the frontend cannot read the
    # router's error chunk as a response ("missing field `created`"): a bare 500
    assert (failed.value.status_code, failed.value.message) == (
        500,
        "Error code: 500 - Internal server error",
    )
    request_id = json.loads((stack.gate / "failed.json").read_text())["request_id"]
    m = _reclaimed(stack, after)
    assert m.group(1) == request_id, m.group(0)
    assert "answered error" in m.group(2) and "failed as armed" in m.group(2), m.group(0)
    assert mooncake_cluster.keys() == []


def test_stage_worker_killed_with_request_in_flight(dynamo_stack, mooncake_cluster):
    """Stage 1 is SIGKILLed while it holds a request (the stub waits on a gate after
    the payload was taken): the client gets an error response, not a hang and not a
    second try. Dynamo 1.6.1 answers it with 400 "Invalid request" (the router's
    error chunk, as the frontend reports it), though the fault was the server's.
    Dynamo's omni router calls each stage once (``round_robin``, no
    migration between stages), so the request fails though stage 0's work was done.
    Nothing is left in the store: stage 1 had consumed the payload."""
    stack = dynamo_stack
    (stack.gate / "armed").touch()
    got: dict[str, object] = {}

    def call() -> None:
        with _client(stack) as client:
            try:
                got["response"] = _generate(client, "a kite over the dunes")
            except Exception as e:
                got["error"] = e

    caller = threading.Thread(target=call, name="dynamo-client")
    caller.start()
    held_file = stack.gate / "held.json"
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while not held_file.exists():
        assert caller.is_alive(), f"the request ended before the gate: {got}"
        assert time.monotonic() < deadline, "stage 1 never held the request"
        time.sleep(0.01)
    held = json.loads(held_file.read_text())
    assert held["pid"] == stack.procs["stage1"].pid
    stack.procs["stage1"].kill()

    caller.join(REQUEST_TIMEOUT_S)
    assert not caller.is_alive(), "the client never got an answer after the kill"
    assert "response" not in got, got
    err = got["error"]
    assert isinstance(err, openai.APIStatusError), repr(err)
    assert (err.status_code, err.message) == (400, "Error code: 400 - Invalid request")
    assert mooncake_cluster.keys() == []


def test_request_while_stage1_is_down_leaves_a_bounded_key(dynamo_stack, mooncake_cluster):
    """A request sent while stage 1 is down fails with a bare 500 (the router runs
    stage 0, then its ``round_robin`` to stage 1 raises: here the dead worker is still
    listed by file discovery and its TCP connection is refused), and stage 0's output
    is left in the store: the known limit of docs/dynamo.md ("A failed request's
    payload"). Nothing the connector sees learns of the failure: Dynamo 1.6.1's
    router calls no connector method on that path, and stage 0 returned before it.
    What is asserted is the bound: every key left is this one request's 0 -> 1
    handoff and expires within ``ttl_s`` (600 s by default), and
    ``cleanup(request_id)`` on any connector (what an operator runs after ``store
    ls``) removes all of it. If a later Dynamo reclaims the payload itself, the
    first assertion on the store fails: update the docs. This router runs with the
    adapter's reclaim hook off (the default): it never says it is on."""
    from mooncake_diffusion_vllm_omni.connector import MooncakeDiffusionConnector

    from mooncake_diffusion.handoff.inventory import inventory

    stack = dynamo_stack
    _stage1_down(stack)
    assert mooncake_cluster.keys() == []
    assert HOOK_ON not in stack.output("router")

    with _client(stack) as client, pytest.raises(openai.APIStatusError) as failed:
        _generate(client, "a ferry in the fog")
    # observed with Dynamo 1.6.1: the router's exception becomes a bare 500
    assert (failed.value.status_code, failed.value.message) == (
        500,
        "Error code: 500 - Internal server error",
    )
    assert stack.procs["stage0"].popen.poll() is None, "stage 0 must have served its part"

    left = inventory(mooncake_cluster.settings)
    assert left, "the failed request left nothing: Dynamo reclaims it now, update the docs"
    records = [e.key for e in left if e.kind == "record"]
    assert len(records) == 1 and records[0].endswith("@0_1"), left
    name = records[0].removeprefix("mcd-mbox/")
    request_id = name.rsplit("@", 1)[0]
    assert {e.kind for e in left} <= {"record", "anchor", "payload", "marker"}, left
    assert all(e.expires_in_s is not None and 0 < e.expires_in_s <= 600.0
               for e in left if e.kind in ("payload", "marker")), left  # fmt: skip
    assert any(e.kind == "marker" and name in e.key for e in left), left

    connector = MooncakeDiffusionConnector(
        {
            "master": mooncake_cluster.settings.master,
            "admin": mooncake_cluster.settings.admin_address,
        }
    )
    try:
        connector.cleanup(request_id)
    finally:
        connector.close()
    assert mooncake_cluster.keys() == []


def _stage1_down(stack) -> None:
    stage1 = stack.procs["stage1"]
    if stage1.popen.poll() is None:  # alone, or after the kill test: stage 1 is down
        stage1.kill()
    stage1.popen.wait(REQUEST_TIMEOUT_S)


def test_reclaim_hook_removes_a_failed_requests_payload(dynamo_stack, mooncake_cluster):
    """The same failure as the test above (stage 1 down, file discovery still listing
    it, the router's ``round_robin`` to it raises, a bare 500), through the router
    with the hook on: stage 0 put its output, and the router's connectors'
    ``cleanup(request_id)`` removed it, so no key is left within RECLAIM_BOUND_S
    (polled; the hook awaits the cleanup before the error goes on, so it is gone
    when the client has the 500). The router logs the reclaim with the stage call's
    failure. Real: the frontend, the router with the hook installed by the
    connector's plugin (nothing of ours imported up front), stage 0's worker and
    the store; stubbed: stage 0's engine (``dyn_stub.py``)."""
    stack = dynamo_stack
    _stage1_down(stack)
    assert mooncake_cluster.keys() == []
    assert HOOK_ON in stack.output("router_reclaim")
    after = len(stack.procs["router_reclaim"].lines)

    with _client(stack) as client, pytest.raises(openai.APIStatusError) as failed:
        _generate(client, "a ferry in the fog", model=RECLAIM_MODEL_NAME)
    assert (failed.value.status_code, failed.value.message) == (
        500,
        "Error code: 500 - Internal server error",
    )
    assert stack.procs["stage0"].popen.poll() is None, "stage 0 must have served its part"

    deadline = time.monotonic() + RECLAIM_BOUND_S
    while (left := mooncake_cluster.keys()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], left
    m = _reclaimed(stack, after)
    assert "raised" in m.group(2), m.group(0)

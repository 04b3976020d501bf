"""The operator front on the demo's stack (a real Mooncake master and store host, the
orchestrator, Encode / Denoise / Decode worker processes running the reference
pipeline): the official ``openai`` client against the OpenAI-style routes."""

from __future__ import annotations

import base64
import io
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
from gated import Gate
from PIL import Image

from mooncake_diffusion.demo import demo_stack
from mooncake_diffusion.testing import assert_no_leaks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def _module_threads():
    """The leak check of this module: the stack spans its tests (its worker processes
    take minutes to warm up), so no thread may outlive the stack rather than each test."""
    baseline = {f"{t.name}#{t.ident}" for t in threading.enumerate()}
    yield
    assert_no_leaks(None, baseline)


@pytest.fixture
def _no_thread_left_behind():
    """Replaces conftest's per-test thread check here: see ``_module_threads``."""
    yield


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """Holds a request's stage where a test asks (``Gate.hold``); others run through."""
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module")
def front(_module_threads, gate, tmp_path_factory):
    # the workers run the reference pipeline's stages through tests/gated.py
    out = tmp_path_factory.mktemp("front")
    with demo_stack(1, out, worker_fn="gated", worker_env=gate.env()) as stack:
        yield stack
        assert stack.svc.cluster()["running"] == []


def colocated_first_frame(prompt: str, seed: int, steps: int, size: int) -> np.ndarray:
    from mooncake_diffusion.pipeline.params import GenerationParams
    from mooncake_diffusion.pipeline.reference import ReferencePipeline

    p = GenerationParams(prompt=prompt, seed=seed, steps=steps, height=size, width=size)
    return ReferencePipeline().run_colocated(p)[0].numpy()


def test_openai_client_gets_images_and_a_video(front):
    client = openai.OpenAI(base_url=f"{front.api.url}/v1", api_key="unused", max_retries=0)
    try:
        extra = {"seed": 5, "num_inference_steps": 2}
        got = client.images.generate(
            prompt="a red fox", size="64x64", response_format="b64_json", extra_body=extra
        )
        png = base64.b64decode(got.data[0].b64_json)
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        assert pixels.shape == (64, 64, 3)
        # the same image as the request run colocated in this process, bit for bit
        assert np.array_equal(pixels, colocated_first_frame("a red fox", 5, 2, 64))

        by_url = client.images.generate(
            prompt="a red fox", size="64x64", response_format="url", extra_body=extra
        )
        url = by_url.data[0].url
        assert url.startswith(front.api.url) and url.endswith("/content"), url
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.read() == png  # same params, same bytes
        rid = url.split("/")[-2]
        assert front.svc.status(rid).slo_class == "interactive"

        video = client.videos.create(prompt="a paper boat", size="96x64", seconds="1")
        assert video.status in ("queued", "in_progress") and video.object == "video"
        assert front.svc.status(video.id).slo_class == "batch"
        while video.status in ("queued", "in_progress"):
            time.sleep(0.2)
            video = client.videos.retrieve(video.id)
        assert video.status == "completed" and video.progress == 100, video
        gif = client.videos.download_content(video.id).read()
        frames = Image.open(io.BytesIO(gif))
        assert frames.format == "GIF" and frames.n_frames == 9 and frames.size == (96, 64)
        assert [v.id for v in client.videos.list().data] == [video.id]

        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(prompt="x", size="63x63")
        assert e.value.code == "bad_value" and "multiple of 16" in e.value.message, e.value
        with pytest.raises(openai.NotFoundError) as e:
            client.videos.retrieve("video_nope")
        assert "video_nope" in e.value.message, e.value.message
    finally:
        client.close()


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def row_cell(rid: str, cls: str) -> str:
    return f"document.querySelector('tr[data-request=\"{rid}\"] td.{cls}')"


def test_dashboard_shows_a_request_appear_advance_and_complete(front, gate):
    """The request's denoise is held at step 5 until the page shows it (the page polls
    every 0.5 s: 100 steps of the tiny model ran between two polls on a fast host)."""
    from playwright.sync_api import sync_playwright

    steps, at = 100, 5
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{front.api.url}/dashboard")
            page.wait_for_selector("#workers tr >> text=den-0")
            gate.hold("dash-1", "denoise", at)
            rid = front.svc.submit(
                {"prompt": "a lighthouse at dusk", "steps": steps, "seed": 9},
                request_id="dash-1",
                slo_class="interactive",
            )
            page.locator(f'tr[data-request="{rid}"]').wait_for(timeout=120_000)
            gate.wait_reached(rid)  # the worker holds it inside step 5
            # advances: the held step, short of the last one, is on the page
            page.wait_for_function(
                f"() => {{ const c = {row_cell(rid, 'step')};"
                f" return c && c.textContent === '{at}/{steps}'; }}",
                timeout=120_000,
            )
            gate.release(rid)
            page.wait_for_function(
                f"() => {{ const c = {row_cell(rid, 'state')};"
                " return c && c.textContent === 'completed'; }",
                timeout=120_000,
            )
            assert front.svc.status(rid).state == "completed"
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            assert (ARTIFACTS / "dashboard.png").stat().st_size > 0
        finally:
            browser.close()


def transfer_series(url: str) -> dict[tuple[str, str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in (
            "mcd_orchestrator_transfers",
            "mcd_orchestrator_transfer_bytes",
            "mcd_orchestrator_transfer_seconds",
        ):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[(fam.name, s.labels["stage"], s.labels["path"])] = s.value
    return out


def test_metrics_count_each_stage_input_by_path(front):
    before = transfer_series(front.api.url)
    rid = front.svc.submit({"prompt": "a hummingbird", "steps": 2, "seed": 4}, request_id="m-1")
    st = front.svc.wait(rid, timeout=300)
    assert st.state == "completed", st
    after = transfer_series(front.api.url)
    done = {e.stage: e.info for e in st.events if e.kind == "done"}
    for stage, prev in (("denoise", "encode"), ("decode", "denoise")):
        path = done[stage]["in_path"]
        key = ("mcd_orchestrator_transfers", stage, path)
        assert after[key] - before.get(key, 0) == 1, (stage, path, after)
        key = ("mcd_orchestrator_transfer_bytes", stage, path)
        assert after[key] - before.get(key, 0) == done[prev]["bytes"], (stage, after)
        key = ("mcd_orchestrator_transfer_seconds", stage, path)
        assert after[key] - before.get(key, 0) == pytest.approx(done[stage]["in_s"])


def test_docs_render_from_the_stacks_own_assets():
    """/docs as Chromium renders it, with every request off the stack refused: Swagger
    UI's files come from the stack (the ``fastapi-offline`` package), not a CDN."""
    from playwright.sync_api import sync_playwright

    from mooncake_diffusion.orchestrator.http.api import ApiServer
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig

    svc = OrchestratorService(ServiceConfig(worker_bind="tcp://127.0.0.1:0")).start()
    api = ApiServer(svc, "127.0.0.1", 0)
    outside: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})

                def only_local(route):
                    if route.request.url.startswith(api.url):
                        route.continue_()
                    else:
                        outside.append(route.request.url)
                        route.abort()

                page.route("**/*", only_local)
                page.goto(f"{api.url}/docs")
                page.wait_for_selector(".opblock-summary-path", timeout=60_000)
                paths = page.locator(".opblock-summary-path").all_inner_texts()
                assert "/v1/requests" in [p.strip() for p in paths], paths
                assert page.locator(".information-container .title").count() == 1
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "docs.png"), full_page=True)
                assert (ARTIFACTS / "docs.png").stat().st_size > 10_000
            finally:
                browser.close()
    finally:
        svc.close()
        api.close()
    assert outside == [], outside  # nothing was fetched from anywhere else

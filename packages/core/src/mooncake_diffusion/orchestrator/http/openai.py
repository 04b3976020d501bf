"""OpenAI-compatible generation routes, the shapes vLLM-Omni and SGLang diffusion serve.

    GET  /v1/models                 -> {"object": "list", "data": [model, ...]}
    GET  /v1/models/{id}            -> the model (404 in OpenAI's shape if not served)
    POST /v1/images/generations     {"prompt", "model"?, "n"?, "size"? "WxH",
                                     "response_format"? "b64_json" | "url",
                                     "negative_prompt"?, "seed"?, "num_inference_steps"?,
                                     "guidance_scale"?}
                                    -> 200 {"created", "data": [{"b64_json" | "url"}]}
                                    (waits for the images: one ``interactive`` request
                                    each; a client that hangs up cancels them, unless
                                    ``FrontConfig.cancel_on_disconnect`` is off)
    GET  /v1/images/{id}/content    -> the PNG
    POST /v1/videos                 JSON or a form (the ``openai`` client sends multipart),
                                    under the same body limits: {"prompt", "model"?,
                                    "size"?, "seconds"?, "num_frames"?, ...}
                                    -> 200 a video object, ``queued`` (a ``batch`` request)
    GET  /v1/videos                 -> {"object": "list", "data": [video, ...]}
    GET  /v1/videos/{id}            -> the video object (status queued / in_progress /
                                       completed / failed, progress 0-100)
    DELETE /v1/videos/{id}          -> cancels it if unfinished, deletes its file:
                                       {"id", "object": "video.deleted", "deleted": true}
    GET  /v1/videos/{id}/content    -> the file (an animated GIF from the reference pipeline)

Each maps onto one orchestrator request per output with the reference pipeline's
params plus ``"save": true``: the decode worker writes the file into its own
configured folder (``MCD_OUTPUTS``; no request names a path), which the server's
``outputs`` folder must be (the same host, or a shared mount); these routes serve it
from there. Without an ``outputs`` folder they answer 503. Every request is checked
before anything is submitted (params, seeds, cost), so a refused one leaves nothing
behind. Errors are OpenAI's shape (``bodies.error_response``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from mooncake_diffusion.orchestrator.http.bodies import (
    ApiError,
    is_form,
    parse,
    read_form,
    read_json,
)
from mooncake_diffusion.orchestrator.http.front import FrontConfig
from mooncake_diffusion.orchestrator.service.service import (
    OrchestratorService,
    RequestRejected,
    ServiceUnavailable,
)
from mooncake_diffusion.orchestrator.service.status import RequestStatus

__all__ = ["ImageRequest", "VideoRequest", "router"]

#: Seconds ``POST /v1/images/generations`` waits for its images.
IMAGE_TIMEOUT_S = 600.0
MAX_IMAGES = 8
#: Videos the routes remember (oldest forgotten first), as the service forgets requests.
MAX_VIDEOS = 10_000
_FPS = 8
_SIZE = r"^\d{1,5}x\d{1,5}$"
_SEED_MAX = 2**63 - 1


class ImageRequest(BaseModel):
    """OpenAI ``images.generate`` fields, plus the diffusion extensions vLLM-Omni takes."""

    model_config = ConfigDict(extra="ignore")
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str = Field("64x64", pattern=_SIZE)
    response_format: Literal["b64_json", "url"] = "b64_json"
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    num_inference_steps: int | None = Field(None, ge=1, le=100_000)
    guidance_scale: float | None = None
    user: str | None = None


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class VideoRequest(BaseModel):
    """OpenAI ``videos.create`` fields, plus the diffusion extensions SGLang takes."""

    model_config = ConfigDict(extra="ignore")
    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str = Field("96x64", pattern=_SIZE)
    seconds: str | None = Field(None, pattern=r"^\d{1,4}$")
    num_frames: int | None = Field(None, ge=1, le=100_000)
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    num_inference_steps: int | None = Field(None, ge=1, le=100_000)
    guidance_scale: float | None = None


class VideoObject(BaseModel):
    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: int | None = None
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    model: str
    prompt: str
    seconds: str
    size: str
    error: dict[str, str] | None = None


def _params(body: ImageRequest | VideoRequest) -> dict[str, Any]:
    """The reference pipeline's params for ``body``; the decode worker saves the file
    into its configured folder (``"save": true``)."""
    width, height = (int(x) for x in body.size.split("x"))
    p: dict[str, Any] = {"prompt": body.prompt, "height": height, "width": width, "save": True}
    for key, v in (
        ("negative_prompt", body.negative_prompt),
        ("seed", body.seed),
        ("steps", body.num_inference_steps),
        ("guidance", body.guidance_scale),
    ):
        if v is not None:
            p[key] = v
    return p


def _checked(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` once the reference pipeline accepts them; ``ApiError`` 400 if not."""
    from mooncake_diffusion.pipeline.params import GenerationParams, ParamsError

    try:
        GenerationParams(**{k: v for k, v in params.items() if k != "save"})
    except (ParamsError, TypeError, ValueError) as e:
        raise ApiError(400, "bad_value", str(e)) from None
    return params


def _file(st: RequestStatus, outputs: Path) -> Path:
    """The output file of a completed request, checked to lie in ``outputs``."""
    if st.state != "completed" or not st.output:
        raise ApiError(409, "not_ready", f"{st.request_id} is {st.state}, not completed")
    try:
        path = Path(json.loads(st.output)["path"]).resolve()
    except (ValueError, KeyError, TypeError):
        raise ApiError(409, "no_output", f"{st.request_id} wrote no file") from None
    if outputs.resolve() not in path.parents or not path.is_file():
        raise ApiError(404, "no_output", f"{st.request_id}'s file is not in the outputs folder")
    return path


def router(
    service: OrchestratorService,
    outputs: Path | None,
    front: FrontConfig | None = None,
    waits: anyio.CapacityLimiter | None = None,
) -> APIRouter:
    """The routes above for ``service``; files are served from ``outputs``. ``front``:
    the models served, cost ceilings, cancel on disconnect; ``waits``: the thread
    limiter of the image waits (``limits.thread_limiters``)."""
    front = front or FrontConfig()
    r = APIRouter()
    videos: dict[str, dict[str, Any]] = {}  # id -> what was asked (model, prompt, ...)
    created = int(time.time())

    def folder() -> Path:
        if outputs is None:
            raise ApiError(503, "no_outputs", "this server was started without an outputs folder")
        outputs.mkdir(parents=True, exist_ok=True)
        return outputs

    def model_object(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "mooncake-diffusion"}

    def served(model: str | None) -> None:
        if model is not None and model not in front.models:
            msg = f"the model {model!r} does not exist here; GET /v1/models lists the served ones"
            raise ApiError(404, "model_not_found", msg, "model")

    @r.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_object(m) for m in front.models]})

    @r.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Response:
        served(model_id)
        return _json(model_object(model_id))

    @r.post(
        "/v1/images/generations",
        response_model=ImagesResponse,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ImageRequest.model_json_schema()}},
            }
        },
    )
    async def images(request: Request) -> Response:
        body: ImageRequest = parse(ImageRequest, await read_json(request) or {})
        served(body.model)
        out = folder()
        params = _checked(_params(body))
        front.check_cost(params, "interactive")
        seeds = [None] * body.n if body.seed is None else [body.seed + i for i in range(body.n)]
        if seeds[-1] is not None and seeds[-1] > _SEED_MAX:
            msg = f"seed + n - 1 must be at most 2**63 - 1, got seed {body.seed} and n {body.n}"
            raise ApiError(400, "bad_value", msg, "seed")
        each = [params if s is None else _checked({**params, "seed": s}) for s in seeds]

        def submit() -> list[str]:
            rids: list[str] = []
            try:
                for p in each:
                    rid = f"img-{uuid.uuid4().hex[:16]}"
                    rids.append(service.submit(p, request_id=rid, slo_class="interactive"))
            except BaseException:
                _cancel(service, rids, "an image of the same call was refused")
                raise
            return rids

        rids = await run_in_threadpool(submit)
        sts = await _wait_all(service, rids, request, front.cancel_on_disconnect, waits)
        data = []
        for st in sts:
            if st.state != "completed":
                why = "; ".join(st.reasons) or st.state
                raise ApiError(500, "generation_failed", f"{st.request_id}: {why}")
            if body.response_format == "url":
                base = str(request.base_url).rstrip("/")
                data.append({"url": f"{base}/v1/images/{st.request_id}/content"})
            else:
                png = _file(st, out).read_bytes()
                data.append({"b64_json": base64.b64encode(png).decode()})
        return _json({"created": int(time.time()), "data": data})

    @r.get("/v1/images/{image_id}/content", response_class=Response)
    async def image_content(image_id: str) -> Response:
        st = await run_in_threadpool(service.status, image_id)
        return Response(_file(st, folder()).read_bytes(), media_type="image/png")

    async def video_body(request: Request) -> VideoRequest:
        if is_form(request):
            fields: dict[str, Any] = dict(await read_form(request))
            for key in ("num_frames", "seed", "num_inference_steps"):
                v = fields.get(key)
                if isinstance(v, str) and v.isdigit() and len(v) <= 20:
                    fields[key] = int(v)
            return parse(VideoRequest, fields)
        return parse(VideoRequest, await read_json(request) or {})

    def video_object(vid: str, st: RequestStatus) -> dict[str, Any]:
        asked = videos.get(vid, {})
        state = {"queued": "queued", "completed": "completed"}.get(st.state)
        if state is None:
            state = "failed" if st.state in ("failed", "cancelled") else "in_progress"
        if st.state == "completed":
            progress = 100
        elif st.stage == "denoise" and st.step and st.total:
            progress = 10 + int(80 * st.step / st.total)
        else:
            progress = {"encode": 5, "decode": 95}.get(st.stage or "", 0)
        obj = {
            "id": vid,
            "object": "video",
            "created_at": int(st.submitted_at),
            "status": state,
            "progress": progress,
            "model": asked.get("model") or front.models[0],
            "prompt": asked.get("prompt", ""),
            "seconds": asked.get("seconds", ""),
            "size": asked.get("size", ""),
        }
        if st.finished_at is not None and state == "completed":
            obj["completed_at"] = int(st.finished_at)
        if state == "failed":
            obj["error"] = {"code": st.state, "message": "; ".join(st.reasons) or st.state}
        return obj

    @r.post("/v1/videos", response_model=VideoObject)
    async def create_video(request: Request) -> Response:
        body = await video_body(request)
        served(body.model)
        folder()
        frames = body.num_frames
        if frames is None:
            secs = int(body.seconds) if body.seconds else 2
            frames = 1 + 4 * max(1, (secs * _FPS) // 4)  # the VAE's 1 + 4k frames
        params = _params(body)
        params["frames"] = frames
        front.check_cost(params, "batch")
        _checked(params)
        vid = f"video_{uuid.uuid4().hex[:16]}"
        seconds = body.seconds or str(max(1, round((frames - 1) / _FPS)))
        while len(videos) >= MAX_VIDEOS:
            videos.pop(next(iter(videos)))
        videos[vid] = {
            "model": body.model,
            "prompt": body.prompt,
            "seconds": seconds,
            "size": body.size,
        }

        def run() -> RequestStatus:
            service.submit(params, request_id=vid, slo_class="batch")
            return service.status(vid)

        try:
            st = await run_in_threadpool(run)
        except BaseException:
            videos.pop(vid, None)
            raise
        return _json(video_object(vid, st))

    @r.get("/v1/videos")
    async def list_videos() -> Response:
        def run() -> list[dict[str, Any]]:
            return [video_object(v, service.status(v)) for v in list(videos)]

        return _json({"object": "list", "data": await run_in_threadpool(run)})

    def known(vid: str) -> None:
        if vid not in videos:
            raise ApiError(404, "unknown_request", f"no video {vid}", "video_id")

    @r.get("/v1/videos/{video_id}", response_model=VideoObject)
    async def retrieve_video(video_id: str) -> Response:
        known(video_id)
        return _json(video_object(video_id, await run_in_threadpool(service.status, video_id)))

    @r.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> Response:
        known(video_id)

        def run() -> None:
            st = service.status(video_id)
            if st.state == "completed":
                with contextlib.suppress(ApiError):  # no file to delete
                    _file(st, folder()).unlink(missing_ok=True)
            else:
                _cancel(service, [video_id], "deleted by client")

        await run_in_threadpool(run)
        videos.pop(video_id, None)
        return _json({"id": video_id, "object": "video.deleted", "deleted": True})

    @r.get("/v1/videos/{video_id}/content", response_class=Response)
    async def video_content(video_id: str) -> Response:
        known(video_id)
        st = await run_in_threadpool(service.status, video_id)
        path = _file(st, folder())
        media = "image/gif" if path.suffix == ".gif" else "image/png"
        return Response(path.read_bytes(), media_type=media)

    return r


def _cancel(service: OrchestratorService, rids: list[str], reason: str) -> None:
    """Cancel each of ``rids`` that is still running (finished ones are left)."""
    for rid in rids:
        # already finished, or the service is going away
        with contextlib.suppress(RequestRejected, ServiceUnavailable):
            service.cancel(rid, reason)


async def _wait_all(
    service: OrchestratorService,
    rids: list[str],
    request: Request,
    cancel_on_disconnect: bool,
    limiter: anyio.CapacityLimiter | None,
) -> list[RequestStatus]:
    """The final statuses of ``rids``, waiting at most ``IMAGE_TIMEOUT_S`` in all; a
    client that disconnects meanwhile cancels them (``cancel_on_disconnect``): 499."""
    gone = False

    def wait() -> list[RequestStatus]:
        deadline = time.monotonic() + IMAGE_TIMEOUT_S
        return [service.wait(r, timeout=max(0.0, deadline - time.monotonic())) for r in rids]

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        await run_in_threadpool(_cancel, service, rids, "the client disconnected")

    async with anyio.create_task_group() as tg:
        if cancel_on_disconnect:
            tg.start_soon(watch)
        sts = await anyio.to_thread.run_sync(wait, limiter=limiter)
        tg.cancel_scope.cancel()
    if gone:
        raise ApiError(499, "client_closed", "the client disconnected; its images were cancelled")
    return sts


def _json(obj: Any, status: int = 200) -> Response:
    import msgspec

    return Response(msgspec.json.encode(obj), status, media_type="application/json")

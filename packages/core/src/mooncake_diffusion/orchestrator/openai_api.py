"""OpenAI-compatible generation routes, the shapes vLLM-Omni and SGLang diffusion serve.

    POST /v1/images/generations     {"prompt", "n"?, "size"? "WxH", "response_format"?
                                     "b64_json" | "url", "negative_prompt"?, "seed"?,
                                     "num_inference_steps"?, "guidance_scale"?}
                                    -> 200 {"created", "data": [{"b64_json" | "url"}]}
                                    (waits for the images: one ``interactive`` request each)
    GET  /v1/images/{id}/content    -> the PNG
    POST /v1/videos                 JSON or multipart form (the ``openai`` client sends a
                                    form): {"prompt", "size"?, "seconds"?, "num_frames"?, ...}
                                    -> 200 a video object, ``queued`` (a ``batch`` request)
    GET  /v1/videos                 -> {"object": "list", "data": [video, ...]}
    GET  /v1/videos/{id}            -> the video object (status queued / in_progress /
                                       completed / failed, progress 0-100)
    GET  /v1/videos/{id}/content    -> the file (an animated GIF from the reference pipeline)

Each maps onto one orchestrator request per output with the reference pipeline's
params plus ``out_dir``: the decode stage writes the file into the server's
``outputs`` folder (shared with the decode workers: the same host, or a shared mount)
and these routes serve it from there. Without an ``outputs`` folder they answer 503.
Errors keep the API's ``{"error", "message"}`` shape.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from mooncake_diffusion.orchestrator.bodies import ApiError, parse, read_json
from mooncake_diffusion.orchestrator.service import OrchestratorService
from mooncake_diffusion.orchestrator.status import RequestStatus

__all__ = ["ImageRequest", "VideoRequest", "router"]

#: Seconds ``POST /v1/images/generations`` waits for its images.
IMAGE_TIMEOUT_S = 600.0
MAX_IMAGES = 8
#: Videos the routes remember (oldest forgotten first), as the service forgets requests.
MAX_VIDEOS = 10_000
_FPS = 8


class ImageRequest(BaseModel):
    """OpenAI ``images.generate`` fields, plus the diffusion extensions vLLM-Omni takes."""

    model_config = ConfigDict(extra="ignore")
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str = Field("64x64", pattern=r"^\d+x\d+$")
    response_format: Literal["b64_json", "url"] = "b64_json"
    negative_prompt: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = Field(None, ge=1)
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
    size: str = Field("96x64", pattern=r"^\d+x\d+$")
    seconds: str | None = Field(None, pattern=r"^\d+$")
    num_frames: int | None = Field(None, ge=1)
    negative_prompt: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = Field(None, ge=1)
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


def _params(body: ImageRequest | VideoRequest, out: Path) -> dict[str, Any]:
    """The reference pipeline's params for ``body``, writing its file into ``out``."""
    width, height = (int(x) for x in body.size.split("x"))
    p: dict[str, Any] = {
        "prompt": body.prompt,
        "height": height,
        "width": width,
        "out_dir": str(out),
    }
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
        GenerationParams(**{k: v for k, v in params.items() if k != "out_dir"})
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


def router(service: OrchestratorService, outputs: Path | None) -> APIRouter:
    """The routes above for ``service``; files go to and are served from ``outputs``."""
    r = APIRouter()
    videos: dict[str, dict[str, Any]] = {}  # id -> what was asked (model, prompt, ...)

    def folder() -> Path:
        if outputs is None:
            raise ApiError(503, "no_outputs", "this server was started without an outputs folder")
        outputs.mkdir(parents=True, exist_ok=True)
        return outputs

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
        out = folder()
        params = _checked(_params(body, out))

        def run() -> list[RequestStatus]:
            rids = []
            for i in range(body.n):
                p = dict(params)
                if body.seed is not None:
                    p["seed"] = body.seed + i
                rid = f"img-{uuid.uuid4().hex[:16]}"
                rids.append(service.submit(p, request_id=rid, slo_class="interactive"))
            return [service.wait(rid, timeout=IMAGE_TIMEOUT_S) for rid in rids]

        sts = await run_in_threadpool(run)
        data = []
        for st in sts:
            if st.state != "completed":
                why = "; ".join(st.reasons) or st.state
                raise ApiError(500, "generation_failed", f"{st.request_id}: {why}")
            if body.response_format == "url":
                data.append(
                    {
                        "url": f"{str(request.base_url).rstrip('/')}/v1/images/"
                        f"{st.request_id}/content"
                    }
                )
            else:
                png = _file(st, out).read_bytes()
                data.append({"b64_json": base64.b64encode(png).decode()})
        return _json({"created": int(time.time()), "data": data})

    @r.get("/v1/images/{image_id}/content", response_class=Response)
    async def image_content(image_id: str) -> Response:
        st = await run_in_threadpool(service.status, image_id)
        return Response(_file(st, folder()).read_bytes(), media_type="image/png")

    async def video_body(request: Request) -> VideoRequest:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
            form = await request.form()
            try:
                fields = {k: v for k, v in form.items() if isinstance(v, str)}
            finally:
                await form.close()
            for key in ("num_frames", "seed", "num_inference_steps"):
                if key in fields and fields[key].lstrip("-").isdigit():
                    fields[key] = int(fields[key])  # type: ignore[assignment]
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
            "model": asked.get("model") or "mooncake-diffusion",
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
        out = folder()
        frames = body.num_frames
        if frames is None:
            secs = int(body.seconds) if body.seconds else 2
            frames = 1 + 4 * max(1, (secs * _FPS) // 4)  # the VAE's 1 + 4k frames
        params = _params(body, out)
        params["frames"] = frames
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
            raise ApiError(404, "unknown_request", f"no video {vid}")

    @r.get("/v1/videos/{video_id}", response_model=VideoObject)
    async def retrieve_video(video_id: str) -> Response:
        known(video_id)
        return _json(video_object(video_id, await run_in_threadpool(service.status, video_id)))

    @r.get("/v1/videos/{video_id}/content", response_class=Response)
    async def video_content(video_id: str) -> Response:
        known(video_id)
        st = await run_in_threadpool(service.status, video_id)
        path = _file(st, folder())
        media = "image/gif" if path.suffix == ".gif" else "image/png"
        return Response(path.read_bytes(), media_type=media)

    return r


def _json(obj: Any, status: int = 200) -> Response:
    import msgspec

    return Response(msgspec.json.encode(obj), status, media_type="application/json")

"""Queue mode: a LightX2V role serving the mooncake-diffusion orchestrator's queue.

With ``disagg_config.queue`` set, ``init_disagg`` makes the role a core
``StageWorker`` of its stage (Encoder: ``encode``, Transformer: ``denoise``,
Decoder: ``decode``) on a background thread, instead of waiting on a room.
Clients submit to the orchestrator (HTTP API ``POST /v1/requests``, ``params``
= the body LightX2V's server takes: ``prompt``, ``negative_prompt``,
``image_path``, ``seed``, ``save_result_path``, ...). Credits, priorities, SLO
classes, failure re-queue and payload release are the orchestrator's; this
module only runs the runner for an item:

    StageWorker hands an item to serve(item, ctx)        (one at a time per runner)
      as LightX2V's server worker (server/services/inference/worker.py) does per request:
      task = params, "task" forced to the role's own, "negative_prompt" defaulted
      input_info = init_empty_input_info(task); update_input_info_from_dict(input_info, task)
      runner.set_reuse(False); runner.set_config(task)    on the role's own config
      runner.run_pipeline(input_info)                     LightX2V's own role flow
        receive_*_outputs()  -> consume item.input          (the upstream stage's output,
                                                             through ctx.connector)
        send_*_outputs(...)  -> the item's output payload   (lease "retained")
      afterwards the role's own config is put back whole (``RoleConfig``)
    StageWorker publishes the output through core's connector, then acknowledges.

Inputs are consumed through the item's ``ctx.connector``: an input whose
producer or store host died is reported as lost, and the orchestrator re-runs
the stage that produced it. Preemption: after each denoising step the progress
callback checks ``ctx.should_yield`` (and ``ctx.cancelled``) and raises
LightX2V's own ``stop_signal``; ``run_segment`` checks it before the next step
and stops, and the item goes back to its queue (it restarts from step 0: a
LightX2V runner keeps no step checkpoint). Runners that do not check
``stop_signal`` (multi-segment ones) run the item to its end.

The routed ``send_*`` / ``receive_*`` methods find the item they belong to
through ``QueueRole.current()`` (a thread-local set around ``run_pipeline``).
Outputs are ``retained`` (an item re-run after a worker death reads its input
again); the orchestrator's ``Release`` drops them when the request finishes.
The Decoder's output, the request's result, is small JSON: ``save_result_path``
and a description of what ``run_pipeline`` returned (dtype, shape, and with
``result_sha256`` the SHA-256 of its bytes).

Obligations and limits: a LightX2V runner is not thread-safe, so items run one
at a time; with ``credits`` > 1 the next items' inputs are received (copied to
``AI_DEVICE``) while the runner is busy, so transfer overlaps compute; one process
per role (``WORLD_SIZE`` > 1 is refused: every rank would pull its own items).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
from types import FrameType
from typing import Any

import msgspec
import torch

from mooncake_diffusion import StagePayload
from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.orchestrator.core.model import WorkItem
from mooncake_diffusion.orchestrator.worker.runtime import StageContext, StageWorker

__all__ = ["QueueItem", "QueueRole", "TaskData", "describe_result"]

logger = logging.getLogger(__name__)

#: request params a client may not set: they would re-route the role
_FORBIDDEN = ("disagg_mode", "disagg_config", "model_cls", "model_path")
_DRAIN_S = 60.0


class TaskData(dict):
    """The request's params as LightX2V's server hands them on (an ``EasyDict``):
    keys are also attributes; a missing attribute reads as ``None``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)


class QueueItem:
    """The item a runner is working on: its input handle, and the payload its
    ``send_*`` call left for the worker to publish."""

    def __init__(self, item: WorkItem, ctx: StageContext) -> None:
        self.item = item
        self.ctx = ctx
        #: the input, received before the runner was free (what ``receive_*`` returns)
        self.prefetched: Any = None
        self.output: StagePayload | None = None


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def describe_result(obj: Any, sha256: bool) -> Any:
    """A JSON-able description of what ``run_pipeline`` returned: tensors as
    ``{"dtype", "shape"[, "sha256"]}``, dicts and lists walked, scalars kept."""
    if isinstance(obj, torch.Tensor):
        out: dict[str, Any] = {"dtype": str(obj.dtype), "shape": list(obj.shape)}
        if sha256:
            out["sha256"] = _digest(obj)
        return out
    if isinstance(obj, dict):
        return {str(k): describe_result(v, sha256) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [describe_result(v, sha256) for v in obj]
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    return type(obj).__name__


def _loading_frame(runner: Any) -> FrameType | None:
    """The outermost ``init_modules`` of ``runner`` on this thread's stack: LightX2V
    calls ``init_disagg`` first in it and loads the models after."""
    outer = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "init_modules" and frame.f_locals.get("self") is runner:
            outer = frame
        frame = frame.f_back
    return outer


def _input_info(task: TaskData) -> Any:
    """LightX2V's input info for one request, built as its server worker builds it."""
    module = importlib.import_module("lightx2v.utils.input_info")
    info = module.init_empty_input_info(task["task"])
    module.update_input_info_from_dict(info, task)
    return info


#: The wire carries whole steps; LightX2V reports a percentage as a float
#: (``progress_callback(33.33.., 100)``). A report with a float in it is sent scaled
#: by this, rounded (``3333`` of ``10000``), so its fraction survives to a hundredth
#: of a percent and every report of a runner has the same total; whole reports (a
#: runner that counts clips, ``(2, 5)``) go as they are.
PROGRESS_SCALE = 100


def progress_steps(step: float, total: float) -> tuple[int, int]:
    """``(step, total)`` as LightX2V reported them, in whole numbers (see ``PROGRESS_SCALE``)."""
    if isinstance(step, float) or isinstance(total, float):
        return round(step * PROGRESS_SCALE), round(total * PROGRESS_SCALE)
    return int(step), int(total)


def _progress(ctx: StageContext, runner: Any) -> Any:
    """LightX2V's ``progress_callback(percent, 100)`` (``percent`` a float, after each
    denoising step) as the orchestrator's progress (``progress_steps``: the fraction
    kept); when the orchestrator asked the
    item to yield (preemption) or dropped it, raises LightX2V's own ``stop_signal``,
    which ``run_segment`` checks before the next step (``check_stop``: it ends the
    run and raises), so the item stops at that step boundary."""

    def report(step: float, total: float) -> None:
        ctx.progress(*progress_steps(step, total))
        if ctx.should_yield or ctx.cancelled:
            runner.stop_signal = True

    return report


class QueueRole:
    """One runner served as a ``StageWorker``; made by ``init_disagg``, ended by
    ``close()`` (from ``release_disagg`` or the adapter's exit hook).

    The worker thread waits until the ``init_modules`` that called ``init_disagg``
    has returned (LightX2V loads the models after ``init_disagg``), then says
    Hello. It is a daemon and is not joined at interpreter exit (LightX2V never
    calls ``release_disagg``): the adapter's exit hook drains it instead."""

    def __init__(self, runner: Any, state: Any) -> None:
        cfg = state.cfg
        q = cfg.queue
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "disagg_config.queue: one process per role (WORLD_SIZE > 1 would make "
                "every rank pull its own items)"
            )
        self.runner = runner
        self.state = state
        self.stage = cfg.connector_role
        self.sha256 = q.result_sha256
        self.ttl_s = None  # the orchestrator releases outputs when the request finishes
        self._run_lock = threading.Lock()
        self._local = threading.local()
        self.error: BaseException | None = None
        # say Hello only once the runner's init_modules (model loading) has returned
        self._loading = _loading_frame(runner)
        self._loader = threading.get_ident()
        self._closing = threading.Event()
        self.worker = StageWorker(
            self.stage,
            self.serve,
            q.orchestrator,
            worker_id=q.worker_id,
            credits=q.credits,
            labels={"engine": "lightx2v", **q.labels},
            connector=state.connector,
            token=q.token,
            publish_timeout_s=cfg.timeout_s,
            connect_timeout_s=q.connect_timeout_s,
        )
        self._thread = threading.Thread(
            target=self._run, name=f"mcd-lightx2v-{self.stage}", daemon=True
        )
        self._thread.start()
        logger.info(
            "[Disagg] mooncake_diffusion queue mode: %s worker %s -> %s, credits %d",
            self.stage,
            self.worker.worker_id,
            q.orchestrator,
            q.credits,
        )

    def _still_loading(self) -> bool:
        top = sys._current_frames().get(self._loader)
        while top is not None:
            if top is self._loading:
                return True
            top = top.f_back
        return False

    def _run(self) -> None:
        while self._loading is not None and self._still_loading():
            if self._closing.wait(0.05):
                return
        self._loading = None  # do not keep init_modules' locals alive
        self.state.role_config.remember()  # the role's own config, before any item
        try:
            self.worker.run(install_signal_handlers=False)
        except BaseException as e:  # a refused Hello, an orchestrator that never answered
            self.error = e
            logger.error("[Disagg] queue worker %s stopped: %s", self.worker.worker_id, e)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def current(self, what: str) -> QueueItem:
        """The item this thread is running; ``ConfigError`` outside one (a request
        that came another way, e.g. a POST to LightX2V's own server)."""
        item = getattr(self._local, "item", None)
        if item is None:
            raise ConfigError(
                f"[Disagg] {what}: this role is in queue mode; its work comes from the "
                f"orchestrator at {self.worker.orchestrator}, submit requests there"
            )
        return item

    def task_data(self, params: Any) -> TaskData:
        if not isinstance(params, dict):
            raise ValueError("request params must be a JSON object")
        bad = sorted(k for k in params if k in _FORBIDDEN)
        if bad:
            raise ValueError(f"request params may not set {bad}")
        task = TaskData({"negative_prompt": "", **params})
        task["task"] = self.runner.config.get("task")  # the role's own, as LightX2V's server
        task["return_result_tensor"] = bool(task.get("return_result_tensor", False))
        return task

    def serve(self, item: WorkItem, ctx: StageContext) -> StagePayload | bytes | None:
        """The stage function: run the runner's own pipeline for ``item``."""
        task = self.task_data(ctx.params)
        current = QueueItem(item, ctx)
        # the input moves while the runner may still be busy with the previous item;
        # through the item's watched connector: a lost input reruns its stage
        if self.stage == "denoise" and item.input:
            config = self.state.role_config.for_request(task)  # the runner may be busy
            current.prefetched = self.state.fetch_phase1(config, item.input, ctx.connector)
        elif self.stage == "decode" and item.input:
            current.prefetched = self.state.fetch_phase2(item.input, ctx.connector)
        with self._run_lock:
            if ctx.cancelled:
                raise RuntimeError("cancelled before it ran")
            if ctx.should_yield:
                return None  # asked to yield before it started: back to its queue
            self._local.item = current
            runner = self.runner
            try:
                input_info = _input_info(task)
                if callable(getattr(runner, "set_reuse", None)):
                    runner.set_reuse(False)
                runner.set_config(task)  # on the role's own config (RoleConfig)
                runner.stop_signal = False
                if callable(getattr(runner, "set_progress_callback", None)):
                    runner.set_progress_callback(_progress(ctx, runner))
                result = runner.run_pipeline(input_info)
            finally:
                self._local.item = None
                runner.stop_signal = False
                self.state.role_config.restore()  # nothing of the request outlives it
        if self.stage == "decode":
            out = {
                "request_id": item.request_id,
                "save_result_path": getattr(input_info, "save_result_path", None) or None,
                "result": describe_result(result, self.sha256),
            }
            return msgspec.json.encode(out)
        if current.output is None:
            raise RuntimeError(
                f"[Disagg] {self.stage}: run_pipeline sent nothing for {item.request_id}"
            )
        return current.output

    def close(self) -> None:
        """Finish the running item, take no new one, say goodbye (up to 60 s; then
        leave: the orchestrator re-queues what was left). Idempotent."""
        self._closing.set()
        if not self._thread.is_alive():
            return
        self.worker.drain()
        self._thread.join(_DRAIN_S)
        if self._thread.is_alive():
            self.worker.stop()
            self._thread.join(10)
